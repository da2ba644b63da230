"""``kiln generate``: sample text (or a chat reply) from a release bundle, checkpoint, GGUF file or registered model."""

from __future__ import annotations

import argparse
from typing import Any

from jobs.commands._common import add_model, add_sampling, loaded_model



def add_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="sample text from a release bundle, checkpoint or registered model")
    add_model(gen)
    gen.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable; default 'The')")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template (a GGUF's own, else Kiln's <|user|>...<|assistant|>)")
    add_sampling(gen, 60, "tokens to sample after each prompt", 0.8, "0 picks the most likely token",
                 seed_help="sampling seed (the same seed gives the same text)")
    gen.set_defaults(fn=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from kiln.model.generate import generate

    _, model, enc, template = loaded_model(args)
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
