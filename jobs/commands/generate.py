"""``kiln generate``: sample text (or a chat reply) from a release bundle, checkpoint, GGUF file or registered model."""

from __future__ import annotations

import argparse
from typing import Any


from jobs.presets import PROJECT
from kiln.release.load import load_chat_model
from jobs.commands._model import model_path


def add_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="sample text from a release bundle, checkpoint or registered model")
    gen.add_argument("model", help="release bundle folder, checkpoint (or run folder), GGUF file, or models:/NAME@ALIAS")
    gen.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable; default 'The')")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template (a GGUF's own, else Kiln's <|user|>...<|assistant|>)")
    gen.add_argument("--max-new-tokens", type=int, default=60, help="tokens to sample after each prompt")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely token")
    gen.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same text)")
    gen.add_argument("--tracking-uri", default=f"sqlite:///{PROJECT / '.kiln' / 'mlflow.db'}", help="MLflow registry for models:/ references")
    gen.set_defaults(fn=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from kiln.model.generate import generate

    path, _ = model_path(args.model, args.tracking_uri)
    try:
        model, enc, template = load_chat_model(path)
    except (OSError, ValueError, RuntimeError) as e:  # damaged bundle, missing checkpoint, corrupt tokenizer
        raise SystemExit(f"kiln: cannot load {path}: {e}") from e
    g = torch.Generator().manual_seed(args.seed)
    for prompt in args.prompt or ["The"]:
        if args.chat:
            from kiln.model.chat import render_ids

            prompt_ids = render_ids(enc, template, [{"role": "user", "content": prompt}])
        else:
            prompt_ids = enc.encode(prompt, allowed_special="all") or [enc.eot_token]
        ids = torch.tensor([prompt_ids])  # (1, T)
        out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       stop_token=enc.eot_token, n_vocab=enc.n_vocab, generator=g)
        text = enc.decode([t for t in out[0].tolist()[ids.size(1):] if t != enc.eot_token])
        print(f"{prompt} ->{text}" if args.chat else f"{prompt}{text}")
    return 0
