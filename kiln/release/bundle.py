"""Release writer: safetensors weights and tokenizer files in the Hugging Face GPT-2 layout, config, card, lineage, checksums.

``write_release(checkpoint, out_dir, card, extra)`` writes a bundle; ``load_release(dir)`` reads it back into a Kiln GPT
(``kiln generate``); ``lineage_tree(read_release_info(dir))`` renders what made it (``kiln lineage``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kiln.train.checkpoint import load_state, resolve_checkpoint
from kiln.model.gpt import GPT, GPTConfig
from kiln.common.files import atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text, sha256_file

# Hugging Face's GPT-2 stores these projections as Conv1D, whose weight is the transpose of nn.Linear's.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
RELEASE_FORMAT = "kiln-release/1"
# The chat layout Kiln's SFT trains on (kiln.posttrain.sft.encode_example), as a Jinja template for apply_chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|endoftext|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Text the exported tokenizer must split exactly as tiktoken does before a bundle is written (a cheap guard;
# the tests compare far more text).
PROBE_TEXTS = (
    "Hello world. The quick brown fox jumps over the lazy dog!",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindented\r\n",
    "   spaces   and trailing   \n\n  ",
    "naïve café — “quotes” … 日本語 中文 한국어 Ελληνικά русский العربية 😀👍🏽",
    "I'm you're he'll we've THEY'D 1234567 3.14159 1,000,000",
    "<|user|>2+2?<|assistant|>4<|endoftext|>",
)


class ReleaseError(ValueError):
    """A bundle is incomplete or damaged, or its files cannot be made to match Kiln; the message names the file."""


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kiln parameter names already follow GPT2LMHeadModel; transpose Conv1D weights, drop the tied head."""
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            continue  # tied to transformer.wte.weight
        t = t.detach().to(torch.float32)
        out[name] = (t.t() if name.endswith(CONV1D) else t).contiguous()
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {name: (t.t() if name.endswith(CONV1D) else t).contiguous() for name, t in state.items()}
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def hf_config(cfg: GPTConfig, eot: int) -> dict[str, Any]:
    if not cfg.bias:
        raise ValueError("Hugging Face GPT-2 needs biases: release a model trained with model.bias=true")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True, "torch_dtype": "float32",
        "dtype": "float32",
    }


# ---- tokenizer files for transformers -------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in.

    Printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards, in byte order.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + n)
    return out


def _split_below(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merge loop on ``token``'s bytes using only ranks below ``max_rank``."""
    parts = [bytes([b]) for b in token]
    while True:
        best: tuple[int, int] | None = None  # (position, rank) of the lowest-ranked adjacent pair
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merge list behind tiktoken ranks, in rank order.

    A multi-byte token's merge is the last step of encoding it with the lower ranks alone, which always
    leaves exactly two parts for a vocabulary that BPE training produced. Written by hand because
    ``tokenizers`` has no tiktoken import and transformers' converter is a test-only dependency here.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = _split_below(ranks, token, rank)
        if len(parts) != 2:
            raise ReleaseError(f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens "
                               f"(lower ranks leave {len(parts)} parts); the vocabulary is not a BPE merge sequence")
        merges.append((parts[0], parts[1]))
    return merges


def hf_tokenizer(enc):
    """A ``tokenizers.Tokenizer`` that gives exactly ``enc.encode(text, allowed_special="all")``.

    Byte-level BPE with the merges recovered from the ranks; the split is the encoding's own regex (Oniguruma
    supports its possessive quantifiers); whole pieces found in the vocabulary are taken as one token before
    any merge (``ignore_merges``), as tiktoken does; special tokens keep Kiln's ids.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    b2u = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(b2u[b] for b in token)

    ranks: dict[bytes, int] = enc._mergeable_ranks
    vocab = {text(t): r for t, r in ranks.items()}
    merges = [(text(a), text(b)) for a, b in recover_merges(ranks)]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = sorted(enc._special_tokens.items(), key=lambda kv: kv[1])
    if [i for _, i in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise ReleaseError(f"special tokens {dict(specials)} do not follow the {len(ranks)} mergeable ranks; "
                           "Hugging Face tokenizers number added tokens after the vocabulary")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in specials])
    return tok


def check_hf_tokenizer(enc, tok, texts=PROBE_TEXTS) -> None:
    """Raise ReleaseError naming the first text that ``tok`` splits differently from ``enc``."""
    for t in texts:
        want, got = enc.encode(t, allowed_special="all"), tok.encode(t).ids
        if want != got:
            raise ReleaseError(f"Hugging Face tokenizer differs from Kiln's on {t!r}: {got[:12]} vs {want[:12]}")


def uses_gpt2_split(enc) -> bool:
    """True when ``enc`` splits text with GPT-2's pattern, which GPT2Tokenizer's vocab.json/merges.txt reproduce."""
    from kiln.tokenizer import GPT2_PAT_STR

    return enc._pat_str == GPT2_PAT_STR


def write_hf_tokenizer(enc, out_dir: Path, model_max_length: int) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json (and vocab.json + merges.txt when exact).

    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` then tokenizes as ``enc`` does. vocab.json and
    merges.txt are written only for GPT-2's split pattern: the classic GPT2Tokenizer hard-codes that pattern,
    so with any other it would tokenize differently. Returns the names written.
    """
    tok = hf_tokenizer(enc)
    check_hf_tokenizer(enc, tok)
    eot = "<|endoftext|>"
    if enc._special_tokens.get(eot) != enc.eot_token:
        raise ReleaseError(f"encoding {enc.name} has no {eot} token; Kiln encodings always have one")
    with atomic_path(out_dir / "tokenizer.json") as tmp:
        tok.save(str(tmp), pretty=True)
    extra = [t for t, _ in sorted(enc._special_tokens.items(), key=lambda kv: kv[1]) if t != eot]
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in sorted(enc._special_tokens.items(), key=lambda kv: kv[1])}
    atomic_write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
        "bos_token": eot, "eos_token": eot, "unk_token": eot, "pad_token": eot,
        "additional_special_tokens": extra, "extra_special_tokens": extra,
        "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
    })
    atomic_write_json(out_dir / "special_tokens_map.json", {
        "bos_token": eot, "eos_token": eot, "unk_token": eot, "pad_token": eot, "additional_special_tokens": extra,
    })
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    if uses_gpt2_split(enc):
        doc = json.loads(tok.to_str())["model"]
        atomic_write_text(out_dir / "vocab.json", json.dumps(doc["vocab"], ensure_ascii=False) + "\n")
        merges = [m if isinstance(m, str) else " ".join(m) for m in doc["merges"]]
        atomic_write_text(out_dir / "merges.txt", "#version: 0.2\n" + "\n".join(merges) + "\n")
        names += ["vocab.json", "merges.txt"]
    return names


# ---- the bundle -----------------------------------------------------------------------------------------


def write_release(checkpoint: str | Path, out_dir: Path, card: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the bundle into ``out_dir`` (which must be a fresh staging folder); return its manifest.

    ``extra`` goes into kiln.json beside what the checkpoint says (model, step, tokenizer); the sections
    ``lineage_tree`` renders are listed in LINEAGE_SECTIONS.
    """
    ckpt = resolve_checkpoint(checkpoint)
    state, meta = load_state(ckpt)
    cfg = GPTConfig(**meta["model"])
    from kiln.tokenizer import encoding_fingerprint, load_encoding

    enc = load_encoding(ckpt / "tokenizer.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(to_hf_state_dict(state["model"]), str(tmp), metadata={"format": "pt"})
    atomic_write_json(out_dir / "config.json", hf_config(cfg, enc.eot_token))
    atomic_write_json(out_dir / "generation_config.json", {
        "bos_token_id": enc.eot_token, "eos_token_id": enc.eot_token, "pad_token_id": enc.eot_token, "do_sample": True,
        "temperature": 0.8, "top_k": 50, "max_new_tokens": 128,
    })
    atomic_write_bytes(out_dir / "tokenizer.kiln.json", (ckpt / "tokenizer.json").read_bytes())
    hf_files = write_hf_tokenizer(enc, out_dir, cfg.block_size)
    atomic_write_json(out_dir / "kiln.json", {
        "format": RELEASE_FORMAT, "model": meta["model"], "source_checkpoint": str(ckpt), "step": meta["step"],
        "task": meta.get("task"), "checkpoint_val_loss": meta.get("val_loss"),
        "tokenizer": {"name": enc.name, "n_vocab": enc.n_vocab, "fingerprint": encoding_fingerprint(enc),
                      "pattern": enc._pat_str, "special_tokens": enc._special_tokens, "hf_files": hf_files},
        **(extra or {}),
    })
    atomic_write_text(out_dir / "README.md", card)
    files = {p.name: sha256_file(p) for p in sorted(out_dir.iterdir()) if p.is_file() and p.name != "SHA256SUMS"}
    atomic_write_text(out_dir / "SHA256SUMS", "".join(f"{h}  {n}\n" for n, h in files.items()))
    return {"files": files, "bytes": sum((out_dir / n).stat().st_size for n in files), "checkpoint": str(ckpt)}


def verify_release(bundle: Path) -> None:
    """Check every file listed in SHA256SUMS; raise ReleaseError naming the first that differs."""
    sums = Path(bundle) / "SHA256SUMS"
    if not sums.is_file():
        raise ReleaseError(f"{sums}: missing; {bundle} is not a release bundle (write one with the release_bundle asset)")
    for line in sums.read_text().splitlines():
        digest, name = line.split("  ", 1)
        if not (bundle / name).is_file():
            raise ReleaseError(f"{bundle / name}: listed in SHA256SUMS but missing; the bundle is incomplete")
        if sha256_file(bundle / name) != digest:
            raise ReleaseError(f"{bundle / name}: checksum does not match SHA256SUMS; the bundle is damaged")


def load_release(bundle: str | Path, map_location: str = "cpu"):
    """(GPT in eval mode, tokenizer) from a release bundle, after verifying its checksums."""
    from kiln.tokenizer import load_encoding

    bundle = Path(bundle)
    verify_release(bundle)
    info = json.loads((bundle / "kiln.json").read_text())
    model = GPT(GPTConfig(**info["model"]))
    model.load_state_dict(from_hf_state_dict(load_file(str(bundle / "model.safetensors"), device=map_location)))
    model.eval()
    return model, load_encoding(bundle / "tokenizer.kiln.json")


# ---- lineage --------------------------------------------------------------------------------------------

# kiln.json sections a release can carry (all optional, passed in ``extra``), in the order ``lineage_tree`` shows them.
LINEAGE_SECTIONS: dict[str, str] = {
    "lineage": "data versions of every upstream asset ({asset: version})",
    "sources": "the source manifest ([{name, kind, package, version, sha256, license, documents}])",
    "filters": "clean_corpus filter and dedup settings ({setting: value})",
    "corpus": "clean_corpus counts ({input_docs, kept_docs, kept_bytes, dedup_rate, removed: {reason: docs}})",
    "tokens": "token counts ({train, val, ...})",
    "plan": "the training plan (parameters, parallelism, batch, hardware)",
    "training": "training summaries per stage ({stage: {steps, tokens, initial_val_loss, final_val_loss, ...}})",
    "eval": "evaluation scores ({metric: value}) and their chance baselines",
    "post_training": "post-training stages ([{stage, version, ...}])",
    "configs": "run config of each asset ({asset: config})",
    "mlflow_runs": "MLflow run id of each asset ({asset: run id})",
    "registry": "the registered version, added by kiln lineage for a models:/ reference ({name, version, aliases})",
}


def read_release_info(bundle: str | Path) -> dict[str, Any]:
    """kiln.json of a bundle, after verifying its checksums."""
    bundle = Path(bundle)
    verify_release(bundle)
    return {"release": str(bundle), **json.loads((bundle / "kiln.json").read_text())}


def checkpoint_lineage(path: str | Path) -> dict[str, Any]:
    """What a checkpoint records about its making: its job (data files, tokenizer, init checkpoint, MLflow run),
    followed through ``init_from`` to the checkpoint it was fine-tuned from."""
    from kiln.train.checkpoint import verify_checkpoint
    from kiln.tokenizer import encoding_fingerprint, load_encoding

    ckpt = resolve_checkpoint(path)
    meta = verify_checkpoint(ckpt)
    enc = load_encoding(ckpt / "tokenizer.json")
    job_path = ckpt.parent.parent / "job.json"  # <run folder>/checkpoints/step_N
    job = json.loads(job_path.read_text()) if job_path.is_file() else {}
    task = meta.get("task") or job.get("task")
    info: dict[str, Any] = {
        "checkpoint": str(ckpt), "step": meta["step"], "task": task, "val_loss": meta.get("val_loss"),
        "model": meta["model"], "tokenizer": {"name": enc.name, "n_vocab": enc.n_vocab, "fingerprint": encoding_fingerprint(enc)},
    }
    if job:
        info["job"] = {k: job.get(k) for k in ("train_files", "val_files", "tokenizer", "seq_len", "micro_batch",
                                               "grad_accum", "max_steps", "seed", "optim") if k in job}
        info["job"]["file"] = str(job_path)
        if job.get("mlflow_run_id"):
            info["mlflow_runs"] = {task or "train": job["mlflow_run_id"]}
        if job.get("init_from"):
            try:
                info["init_from"] = checkpoint_lineage(job["init_from"])
            except Exception as e:  # the parent run folder was cleaned away: say so instead of failing
                info["init_from"] = {"checkpoint": job["init_from"], "error": str(e)}
    return info


def _scalar(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, default=str)
    return str(v)


def _tree(value: Any, indent: str, lines: list[str], max_items: int = 12) -> None:
    """Append ``value`` as indented ``key: value`` lines; lists of records become one line per record."""
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value)) if isinstance(value, list) else None
    if items is None:
        lines.append(f"{indent}{_scalar(value)}")
        return
    for k, v in items[:max_items] if max_items else items:
        if isinstance(value, list) and isinstance(v, dict):
            head = next((h for h in ("name", "stage", "task") if h in v), None)
            rest = ", ".join(f"{kk}={_scalar(x)}" for kk, x in v.items() if kk != head)
            lines.append(f"{indent}- {v[head] if head else k}: {rest}")
        elif isinstance(value, list):
            lines.append(f"{indent}- {_scalar(v)}")
        elif isinstance(v, dict) and v or isinstance(v, list) and any(isinstance(x, dict) for x in v):
            lines.append(f"{indent}{k}:")
            _tree(v, indent + "  ", lines, max_items)
        else:
            lines.append(f"{indent}{k}: {_scalar(v)}")
    if max_items and len(items) > max_items:
        lines.append(f"{indent}... {len(items) - max_items} more (--full shows all)")


def lineage_tree(info: dict[str, Any], full: bool = False) -> str:
    """A readable tree of a release's (or checkpoint's) lineage: what made the model, section by section."""
    lines: list[str] = []
    limit = 0 if full else 12
    if "release" in info:
        lines.append(" ".join(str(x) for x in ("release", info.get("name"), info["release"]) if x))
        lines.append(f"  from checkpoint {info.get('source_checkpoint')} (step {info.get('step')}, task {info.get('task')})")
    else:
        lines.append(f"checkpoint {info['checkpoint']} (step {info.get('step')}, task {info.get('task')}, "
                     f"val loss {_scalar(info.get('val_loss'))})")
    m = info.get("model") or {}
    if m:
        lines.append(f"  model: {m.get('n_layer')} layers x {m.get('n_head')} heads x width {m.get('n_embd')}, "
                     f"context {m.get('block_size')}, vocabulary {m.get('vocab_size')}")
    t = info.get("tokenizer") or {}
    if t:
        lines.append(f"  tokenizer: {t.get('name')} ({t.get('n_vocab')} tokens, fingerprint {str(t.get('fingerprint'))[:16]})")
    shown = {"release", "name", "source_checkpoint", "step", "task", "model", "tokenizer", "checkpoint", "val_loss",
             "format", "checkpoint_val_loss", "init_from"}
    for key in [*LINEAGE_SECTIONS, *(k for k in info if k not in LINEAGE_SECTIONS and k not in shown)]:
        if key in shown or info.get(key) in (None, {}, []):
            continue
        lines.append(f"  {key}:")
        _tree(info[key], "    ", lines, limit)
    if "init_from" in info:
        lines.append("  fine-tuned from:")
        lines += ["    " + line for line in lineage_tree(info["init_from"], full).splitlines()]
    return "\n".join(lines) + "\n"
