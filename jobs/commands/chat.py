"""``kiln chat``: a conversation on the terminal in the model's chat template, streamed, the KV cache kept."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from jobs.commands._common import add_model, add_sampling, loaded_model



def add_parser(sub: Any) -> None:
    ch = sub.add_parser("chat", help="talk with a model in its chat template, answers streamed, the conversation kept")
    add_model(ch)
    ch.add_argument("--message", action="append", default=None, help="a turn to send instead of reading the terminal (repeatable)")
    ch.add_argument("--system", default="", help="a system message to start the conversation with")
    ch.add_argument("--template", default="", help="a file holding the chat template (Jinja) to use instead of the model's")
    add_sampling(ch, 256, "most tokens in one answer", 0.0, "0 (the default) picks the most likely token",
                 "sample among the k most likely tokens (with a temperature)")
    ch.set_defaults(fn=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on the terminal: each line a turn (``--message`` for scripted turns); /reset starts over."""
    import torch

    from kiln.model.chat import ChatError, ChatSession

    path, model, enc, template = loaded_model(args, args.template)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    new = lambda: ChatSession(model, enc, template, system=args.system, max_new_tokens=args.max_new_tokens,  # noqa: E731
                              temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    session, tty = new(), sys.stdin.isatty() and not args.message
    if tty:
        print(f"kiln chat: {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters); "
              "/reset starts over, /quit or Ctrl-D ends", flush=True)
    turns = iter(args.message) if args.message else iter(lambda: input("you> ") if tty else sys.stdin.readline(), "")
    for line in turns:
        text = line.rstrip("\n")
        if text.strip() in ("/quit", "/exit"):
            break
        if text.strip() == "/reset":
            session = new()
            continue
        if not text.strip():
            continue
        if not tty:
            print(f"you> {text}", flush=True)
        print("model> ", end="", flush=True)
        try:
            for piece in session.reply(text):
                print(piece, end="", flush=True)
        except ChatError as e:
            print(f"\nkiln: {e}; /reset starts a new conversation", flush=True)
            continue
        print(flush=True)
    return 0
