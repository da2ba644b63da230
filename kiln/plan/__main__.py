"""``python -m kiln.plan --preset gpt2 --seq-len 1024 --global-batch 512 --device cuda --nproc 8 --memory-gb 80``
prints the single-node plan (parallelism, activation checkpointing, micro-batch, accumulation, memory, FLOPs, hours).
"""

from __future__ import annotations

import argparse
import json

from kiln.model.config import ModelConfig, preset_fields
from kiln.plan.memory import BatchConfig, HardwareConfig, make_plan


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo", help="model size: tiny, demo, gpt2, gpt2-medium, gpt2-large, gpt2-xl "
                   "(gpt2 family); tiny, demo, 125m, smollm-135m, llama3.2-1b (llama)")
    p.add_argument("--family", default="gpt2", help="model family: gpt2 or llama (kiln.model.config.MODEL_PRESETS)")
    p.add_argument("--vocab-size", type=int, default=None, help="padded vocabulary (default 50304 for gpt2*, else 8192)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=800)
    p.add_argument("--device", default="cpu")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--memory-gb", type=float, default=None)
    a = p.parse_args(argv)
    fields = preset_fields(a.preset, a.family)
    fields["vocab_size"] = a.vocab_size or (50304 if a.preset.startswith("gpt2") else 8192)
    plan = make_plan(ModelConfig(**fields), BatchConfig(a.seq_len, a.global_batch, None, a.max_steps),
                     HardwareConfig(a.device, a.nproc, a.nnodes, a.memory_gb))
    print(json.dumps(plan.to_dict(), indent=2))


if __name__ == "__main__":
    main()
