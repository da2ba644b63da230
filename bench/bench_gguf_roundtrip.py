"""Kiln's GGUF out, read back by the two readers people use: transformers' GGUF loader (logits) and llama.cpp through
llama-cpp-python (greedy tokens and tokenization), against Kiln on the same weights.

Run: ``python bench/bench_gguf_roundtrip.py [--model PATH] [--llama-python PY] [--out bench/results/gguf_roundtrip]``.
The model: a release bundle, checkpoint or GGUF file (default: SmolLM2-135M-Instruct imported from its pinned package,
as bench/bench_gguf.py fetches it). Kiln writes it as F16 and Q8_0 (kiln.release.gguf). llama.cpp runs in
``--llama-python``, a Python with ``llama-cpp-python==0.3.36`` built from its PyPI sdist (``python -m venv V &&
V/bin/pip install llama-cpp-python==0.3.36``; it builds llama.cpp with the machine's compiler), in a child process.
Writes OUT.md and OUT.json with the command, commit, date and machine line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from provenance import header, header_md, machine_line  # noqa: E402

PROMPTS = ("The history of the printing press begins",
           "<|im_start|>user\nName three primary colours.<|im_end|>\n<|im_start|>assistant\n")
TEXTS = ("Hello world. 12345 apples, 3.14159 and 1,000,000.", "naïve café — “quotes” … 日本語",
         "def f(x):\n    return x ** 2  # square\n\n\tindented\n", "I'm you're he'll we've THEY'D")

LLAMA_SCRIPT = r"""
import json, sys
from llama_cpp import Llama
req = json.loads(sys.stdin.read())
llm = Llama(model_path=req["path"], n_ctx=512, n_threads=req["threads"], verbose=False, logits_all=False)
out = {"version": __import__("llama_cpp").__version__, "generations": [], "tokens": []}
for ids in req["prompts"]:
    got = []
    for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        got.append(int(t))
        if len(got) == req["n"]:
            break
    out["generations"].append(got)
for text in req["texts"]:
    out["tokens"].append(llm.tokenize(text.encode(), add_bos=False, special=False))
print(json.dumps(out))
"""


def load(path: str):
    sys.path.insert(0, str(ROOT))
    from kiln.release.load import load_any_model

    return load_any_model(path)


def rounded(model, cfg):
    """A copy of ``model`` with every matrix rounded to F16, as the F16 file holds it."""
    from kiln.model.families import build_model

    m = build_model(cfg).eval()
    m.load_state_dict({k: (v.half().float() if v.dim() == 2 else v) for k, v in model.state_dict().items()})
    return m


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="", help="release bundle, checkpoint or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--cache", default=str(ROOT / ".kiln" / "storage" / "cache" / "sources"))
    ap.add_argument("--llama-python", default="", help="a Python with llama-cpp-python (empty: llama.cpp not run)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gguf_roundtrip"))
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.model.generate import generate
    from kiln.release.gguf import write_gguf

    if args.model:
        source = args.model
    else:
        from bench_gguf import fetch_model

        source = str(fetch_model(Path(args.cache)))
    model, enc = load(source)
    model.eval()
    cfg = model.config
    name = Path(source).name
    work = Path(tempfile.mkdtemp(prefix="gguf-rt-"))
    rows, gens = [], {}
    ids = torch.randint(0, enc.n_vocab, (2, 96), generator=torch.Generator().manual_seed(0))  # (2, 96)
    text = torch.tensor([enc.encode(" ".join(TEXTS) + " " + PROMPTS[0] + " with Gutenberg's movable type in Mainz, "
                                    "and within fifty years presses ran in more than two hundred cities.",
                                    allowed_special="all")])  # (1, T)
    prompts = [enc.encode(p, allowed_special="all") for p in PROMPTS]
    for qtype in ("F16", "Q8_0"):
        t0 = time.perf_counter()
        info = write_gguf(model.state_dict(), cfg, enc, work / f"model-{qtype}.gguf", qtype, name=name)
        write_s = time.perf_counter() - t0
        ref = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=f"model-{qtype}.gguf", dtype=torch.float32).eval()
        with torch.no_grad():
            hf = ref(ids).logits[..., : enc.n_vocab]
            vs_kiln = (hf - model(ids)[..., : enc.n_vocab]).abs().max().item()
            vs_rounded = (hf - rounded(model, cfg)(ids)[..., : enc.n_vocab]).abs().max().item() if qtype == "F16" else None
            hf_t, kiln_t = ref(text).logits[..., : enc.n_vocab], model(text)[..., : enc.n_vocab]
            text_diff = (hf_t - kiln_t).abs().max().item()
            top1 = (hf_t.argmax(-1) == kiln_t.argmax(-1)).float().mean().item()
        rows.append({"type": qtype, "bytes": info["bytes"], "sha256": info["sha256"], "tensor_types": info["tensor_types"],
                     "write_s": round(write_s, 1), "transformers_vs_kiln": vs_kiln,
                     "transformers_vs_kiln_f16_weights": vs_rounded, "text_tokens": text.shape[1],
                     "text_vs_kiln": text_diff, "text_top1_agreement": top1})
        print(f"{qtype}: {info['bytes']:,} bytes; transformers vs Kiln {vs_kiln:.3g} (text {text_diff:.3g}, top-1 {top1:.3f})"
              + (f", vs Kiln with F16 weights {vs_rounded:.3g}" if vs_rounded is not None else ""), flush=True)
    f16 = rounded(model, cfg)
    kiln_gen = []
    with torch.no_grad():
        for p in prompts:
            out = generate(f16, torch.tensor([p]), args.tokens, temperature=0.0, n_vocab=enc.n_vocab)
            kiln_gen.append(out[0, len(p):].tolist())
    hf_tok = AutoTokenizer.from_pretrained(str(work), gguf_file="model-F16.gguf")
    tok_rows = [{"text": t, "kiln": enc.encode(t), "transformers": hf_tok(t, add_special_tokens=False)["input_ids"]}
                for t in TEXTS]
    llama = None
    if args.llama_python:
        req = {"path": str(work / "model-F16.gguf"), "prompts": prompts, "n": args.tokens, "texts": list(TEXTS),
               "threads": max(1, torch.get_num_threads())}
        t0 = time.perf_counter()
        proc = subprocess.run([args.llama_python, "-c", LLAMA_SCRIPT], input=json.dumps(req), capture_output=True,
                              text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"llama.cpp failed ({proc.returncode}): {proc.stderr[-2000:]}")
        llama = json.loads(proc.stdout.strip().splitlines()[-1])
        llama["wall_s"] = round(time.perf_counter() - t0, 1)
        for i, (a, b) in enumerate(zip(kiln_gen, llama["generations"])):
            print(f"llama.cpp greedy {len(b)} tokens of prompt {i}: {'identical' if a == b else 'DIFFERENT'}: "
                  f"{enc.decode(b)[:60]!r}", flush=True)
    result = {**header(argv if argv is not None else sys.argv), "model": source, "gguf": rows,
              "kiln_greedy": [enc.decode(g) for g in kiln_gen], "tokenization": [
                  {"text": r["text"], "transformers_identical": r["kiln"] == r["transformers"],
                   **({"llama_cpp_identical": r["kiln"] == llama["tokens"][i]} if llama else {})}
                  for i, r in enumerate(tok_rows)],
              "llama_cpp": None if llama is None else {
                  "version": llama["version"], "wall_s": llama["wall_s"],
                  "greedy_identical": [a == b for a, b in zip(kiln_gen, llama["generations"])],
                  "first_difference": [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                       for a, b in zip(kiln_gen, llama["generations"])],
                  "text": [enc.decode(g) for g in llama["generations"]]}}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    md = [f"# GGUF round trip: {name} written by Kiln, read by transformers and llama.cpp", "",
          *header_md(argv if argv is not None else sys.argv),
          "Max abs logit difference of transformers' GGUF loader against Kiln's model (2 x 96 random ids, seed 0; and a "
          f"text of {rows[0]['text_tokens']} tokens, with how often both pick the same next token):", "",
          "| file | bytes | tensor types | random ids vs Kiln | vs Kiln with F16-rounded weights | text vs Kiln | same top-1 on the text |",
          "|---|---:|---|---:|---:|---:|---:|",
          *[f"| model-{r['type']}.gguf | {r['bytes']:,} | {', '.join(f'{k} {v}' for k, v in r['tensor_types'].items())} | "
            f"{r['transformers_vs_kiln']:.3g} | {'-' if r['transformers_vs_kiln_f16_weights'] is None else format(r['transformers_vs_kiln_f16_weights'], '.3g')} | "
            f"{r['text_vs_kiln']:.3g} | {r['text_top1_agreement']:.3f} |"
            for r in rows], ""]
    if llama:
        md += [f"llama.cpp (llama-cpp-python {llama['version']}, built from its PyPI sdist on this machine) loads "
               f"model-F16.gguf; greedy {args.tokens} tokens, against Kiln's with the F16-rounded weights:", "",
               "| prompt | identical | first difference | llama.cpp's text |", "|---|---|---:|---|",
               *[f"| {PROMPTS[i][:40]!r} | {'yes' if same else 'no'} | {'-' if d is None else d} | {t[:70]!r} |"
                 for i, (same, d, t) in enumerate(zip(result['llama_cpp']['greedy_identical'],
                                                      result['llama_cpp']['first_difference'], result['llama_cpp']['text']))],
               ""]
    else:
        md += ["llama.cpp was not run (no --llama-python).", ""]
    md += ["Token ids of fixed texts, Kiln's encoding against each reader's tokenizer from the GGUF metadata:", "",
           "| text | transformers | llama.cpp |", "|---|---|---|",
           *[f"| {r['text'][:34]!r} | {'identical' if r['transformers_identical'] else 'differ'} | "
             f"{('identical' if r['llama_cpp_identical'] else 'differ') if 'llama_cpp_identical' in r else '-'} |"
             for r in result["tokenization"]], ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print(f"wrote {out.with_suffix('.md')}", flush=True)
    return result


if __name__ == "__main__":
    main()
