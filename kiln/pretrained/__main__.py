"""Import a local Hugging Face folder as a Kiln checkpoint and tokenizer: ``python -m kiln.pretrained FOLDER OUT``."""

from __future__ import annotations

import argparse
import json

from kiln.pretrained.source import import_pretrained


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("folder", help="Hugging Face model folder: config.json, model.safetensors (or shards), tokenizer.json")
    ap.add_argument("out", help="where the checkpoint (checkpoints/step_0000000), tokenizer.json and pretrained.json go")
    args = ap.parse_args(argv)
    record = import_pretrained(args.folder, args.out)
    print(json.dumps({k: record[k] for k in ("source", "sha256", "license", "model_type", "checkpoint", "n_vocab")},
                     indent=2))


if __name__ == "__main__":
    main()
