"""Kiln's adapter against lm-eval's own transformers model (HFLM) on the same items: per-request log-likelihoods,
accuracies, greedy generations and scores side by side (the proof that Kiln's scores are lm-eval's).

``compare(prepared, {"kiln": kiln_lm(...), "hf": hf_lm(folder)})`` returns one row per benchmark; bench/bench_parity.py
prints and writes them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kiln.evaluation.standard.run import Prepared, evaluate_lm, load_tasks, scores


def hf_lm(folder: str | Path, batch_size: int = 16, max_length: int | None = None, device: str = "cpu") -> Any:
    """lm-eval's HFLM on a Hugging Face folder (or a GGUF file, which transformers dequantises), in float32."""
    from lm_eval.models.huggingface import HFLM

    path = Path(folder)
    gguf = {"pretrained": str(path.parent), "gguf_file": path.name} if path.suffix.lower() == ".gguf" else {}
    lm = HFLM(**{"pretrained": str(path), **gguf}, batch_size=batch_size, max_length=max_length, device=device,
              dtype="float32")
    if gguf:
        use_gguf_pretokenizer(lm.tokenizer, path)
    return lm


def use_gguf_pretokenizer(tokenizer: Any, path: str | Path) -> str:
    """Split text before BPE as the GGUF's ``tokenizer.ggml.pre`` says, in a transformers tokenizer loaded from it.

    transformers' GGUF loader builds a byte-level BPE tokenizer with GPT-2's split whatever that field names, so a
    'smollm' vocabulary (digits split one by one first, as llama.cpp and the model's own tokenizer split them) turns
    " Wash  4" into " Wash", " ", " ", "4" where llama.cpp and Kiln give " Wash", "  ", "4": the same text, other
    tokens, another log-likelihood. The parity check compares models, so both sides get the GGUF's split (Kiln's
    import reads it, kiln.pretrained.gguf.PRE_TOKENIZERS). Returns the pre-tokenizer set, as text."""
    import json

    from tokenizers import Tokenizer

    from kiln.pretrained.gguf import read_gguf

    doc = read_gguf(path, weights=False).tokenizer
    tokenizer.backend_tokenizer.pre_tokenizer = Tokenizer.from_str(json.dumps(doc)).pre_tokenizer
    return str(doc.get("pre_tokenizer"))


def kiln_lm(folder: str | Path, work_dir: str | Path, batch_size: int = 16, max_length: int | None = None,
            device: str = "cpu") -> Any:
    """KilnLM on the Kiln checkpoint that kiln.pretrained imports from a Hugging Face folder (or GGUF file)."""
    from kiln.evaluation.adapter import KilnLM
    from kiln.pretrained.source import import_pretrained

    record = import_pretrained(folder, work_dir)
    return KilnLM.from_checkpoint(record["checkpoint"], device=device, batch_size=batch_size, max_length=max_length)


def responses(out: dict[str, Any]) -> dict[tuple[str, int, int], Any]:
    """{(task, doc_id, request index): the model's raw answer} from lm-eval's logged samples: (loglik, is_greedy)
    for log-likelihood requests, the generated text for generation requests."""
    got = {}
    for task, samples in out.get("samples", {}).items():
        for s in samples:
            for i, resp in enumerate(s["resps"]):
                got[(task, int(s["doc_id"]), i)] = resp[0] if isinstance(resp, list) and len(resp) == 1 else resp
    return got


def _loglik(v: Any) -> float | None:
    if isinstance(v, (tuple, list)) and len(v) == 2 and isinstance(v[0], (int, float)):
        return float(v[0])
    return None


def compare(prepared: Prepared, sides: dict[str, Any], max_gen_toks: int | None = None,
            bootstrap_iters: int = 100) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Score every side on the same loaded tasks and items, one benchmark at a time. Returns (rows, outputs): per
    benchmark its items, requests, the max |delta loglik|, greedy flags and generations that differ between the first
    side and each other, each side's score, stderr, wall seconds and requests/s; outputs: {benchmark: {side: lm-eval's
    output}}."""
    first = next(iter(sides))
    rows, outs = [], {}
    for bench in prepared.names:
        sub = Prepared([bench], prepared.task_dir, prepared.samples, prepared.record,
                       {bench: prepared.benchmarks[bench]})
        loaded = load_tasks(sub)
        outs[bench], secs = {}, {}
        for name, lm in sides.items():
            t0 = time.perf_counter()
            outs[bench][name] = evaluate_lm(lm, sub, loaded=loaded, max_gen_toks=max_gen_toks, log_samples=True,
                                            bootstrap_iters=bootstrap_iters)
            secs[name] = time.perf_counter() - t0
        flat = {name: scores(out, sub)[bench] for name, out in outs[bench].items()}
        resp = {name: responses(out) for name, out in outs[bench].items()}
        keys = sorted(resp[first])
        lls = [abs(v) for v in map(_loglik, resp[first].values()) if v is not None]
        row: dict[str, Any] = {"benchmark": bench, "items": flat[first]["items"], "requests": len(keys),
                               "primary": prepared.benchmarks[bench].primary, "max_abs_loglik": max(lls, default=None)}
        for name in sides:
            row[f"{name}_score"] = flat[name]["score"]
            row[f"{name}_stderr"] = flat[name]["stderr"]
            row[f"{name}_seconds"] = round(secs[name], 3)
            row[f"{name}_requests_per_s"] = round(len(keys) / max(secs[name], 1e-9), 2)
            if name == first:
                continue
            pairs = [(resp[first][k], resp[name].get(k)) for k in keys]
            both = [(_loglik(a), _loglik(b)) for a, b in pairs if _loglik(a) is not None and _loglik(b) is not None]
            deltas = [abs(a - b) for a, b in both]
            texts = [(a, b) for a, b in pairs if isinstance(a, str)]
            row[f"missing_{name}"] = sum(b is None for _, b in pairs)
            row[f"max_dloglik_{name}"] = max(deltas) if deltas else None
            rel = [abs(a - b) / max(abs(a), 1.0) for a, b in both]
            row[f"max_rel_dloglik_{name}"] = max(rel) if rel else None  # float32 sums: ~1e-7 of |loglik| is noise
            row[f"greedy_differ_{name}"] = sum(bool(a[1]) != bool(b[1]) for a, b in pairs
                                               if _loglik(a) is not None and _loglik(b) is not None)
            row[f"generations_differ_{name}"] = sum(a != b for a, b in texts) if texts else None
        rows.append(row)
    return rows, outs


def save_tiny_llama(folder: str | Path, positions: int = 512, vocab: int = 512, seed: int = 0) -> Path:
    """A random tiny transformers llama (2 layers, width 32) with a byte-level BPE holding Kiln's chat tokens, so
    that Kiln's import adds no ids and both sides normalise over the same vocabulary: the model the parity check
    and its test run when no released model is given."""
    import json

    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kiln.tokens.tokenizer import SPECIAL_TOKENS

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = ("the a of to and is in that it for on was with as by question answer which what def return if "
             "print 0 1 2 3 4 5 6 7 8 9 + - = ( ) [ ] : , . ? ! \" ' # $ \\frac{ } x y").split()
    rng = __import__("random").Random(seed)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 30))) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(folder / "tokenizer.json"))
    eot = tok.token_to_id(SPECIAL_TOKENS[0])
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL_TOKENS[0], "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": positions}))
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot,
                         pad_token_id=eot)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper next-token choices than the default init: greedy decoding far from ties
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(str(folder))
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a random tiny llama (parity checks)\n")
    return folder
