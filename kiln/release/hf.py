"""Hugging Face formats of a Kiln model: its family's weight layout and config (kiln.model.families), and the
tokenizer with Kiln's ids.

Use: ``to_hf_state_dict(state, cfg)``, ``hf_config(cfg, eot)``, ``hf_tokenizer(enc).encode(text).ids``;
``write_release`` writes them into a bundle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kiln.common.files import atomic_path, atomic_write_json, atomic_write_text
from kiln.model import mup
from kiln.model.config import ModelConfig
from kiln.model.families import of
from kiln.tokens.tokenizer import chat_template

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


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Kiln's state dict in the layout transformers loads for ``cfg``'s family (kiln.model.families.Family.to_hf).
    A muP model away from its base width has its attention scale and output multiplier folded into the weights
    (kiln.model.mup: the query projection and the final norm), so transformers' plain model computes Kiln's logits."""
    fold = _mup_folds(cfg)
    if fold is not None:
        state = of(cfg).adapter.mup_fold(state, cfg, *fold)
    return of(cfg).to_hf(state, cfg)


def from_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of to_hf_state_dict: Kiln's state dict, with a tied head pointing at the embedding (and a muP
    model's folded multipliers taken back out of the weights)."""
    out = of(cfg).from_hf(state, cfg)
    fold = _mup_folds(cfg)
    if fold is not None:
        out = of(cfg).adapter.mup_fold(out, cfg, *(1.0 / f for f in fold))  # the tables (and a tied head) are not folded
    return out


def _mup_folds(cfg: ModelConfig) -> tuple[float, float] | None:
    """(query factor, final-norm factor) folding a muP model's multipliers into Hugging Face's weights; None where
    there is nothing to fold (the standard parametrisation, or muP at its base width); a family that cannot fold
    them is refused."""
    if not mup.scaled(cfg):
        return None
    if of(cfg).adapter.mup_fold is None:
        raise ReleaseError(
            f"model.mup_base_width={cfg.mup_base_width} with n_embd={cfg.n_embd}: this muP model multiplies its logits "
            f"by 1/{mup.width_mult(cfg):g} and scales attention by sqrt(d_base)/d, and the {cfg.family} family has "
            "no rule to fold them into Hugging Face's weights (StateDictAdapter.mup_fold), whose model has neither multiplier; "
            "release a model trained with model.mup_base_width equal to model.n_embd (muP at its base width is the "
            "standard model) or 0, or give the family a mup_fold")
    return mup.hf_folds(cfg)


def hf_config(cfg: ModelConfig, eot: int) -> dict[str, Any]:
    """config.json for transformers, as ``cfg``'s family writes it (GPT2LMHeadModel, LlamaForCausalLM, ...)."""
    return of(cfg).adapter.hf_config(cfg, eot)


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


def special_layout(enc, vocab: dict[str, int]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Place the encoding's special tokens for ``tokenizers``: (in the BPE vocabulary at their ids, added after it).

    ``tokenizers`` numbers an added token that is not in the model's vocabulary after that vocabulary (its size,
    then one up), so the longest run of specials that continues a gapless vocabulary is added after it (Kiln's
    own layout: specials right after the ranks) and every other special (SmolLM's at ids 0..k-1, or after a gap)
    is written into the vocabulary at its id, as such tokenizers ship. ``vocab``: the ranks' byte-level text -> id.
    Raises ReleaseError naming a special whose id or text collides with a mergeable token or another special.
    """
    by_id = {i: t for t, i in vocab.items()}
    specials = sorted(enc._special_tokens.items(), key=lambda kv: kv[1])
    for n, (t, i) in enumerate(specials):
        if i in by_id:
            raise ReleaseError(f"special token {t!r} has id {i}, which is also the mergeable token {by_id[i]!r}; "
                               "one id cannot be two tokens: give the special an unused id")
        if t in vocab:
            raise ReleaseError(f"special token {t!r} (id {i}) is spelled like the vocabulary token of id {vocab[t]}; "
                               "a Hugging Face tokenizer would give that id for it: rename the special")
        if n and specials[n - 1][1] == i:
            raise ReleaseError(f"special tokens {specials[n - 1][0]!r} and {t!r} share id {i}; give each its own id")
    for j in range(len(specials)):
        start = len(vocab) + j  # where tokenizers puts the first added token after vocab + specials[:j]
        if (max([*by_id, *(i for _, i in specials[:j])], default=-1) < start
                and all(i == start + n for n, (_, i) in enumerate(specials[j:]))):
            return specials[:j], specials[j:]
    return specials, []


def _check_unreachable(tok, inner: list[tuple[str, int]]) -> None:
    """Refuse a special in the BPE vocabulary that a piece of ordinary text spells: ``ignore_merges`` would give the
    special's id there, where tiktoken gives ordinary tokens."""
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    for t, i in inner:
        if not all(c in u2b for c in t):
            continue
        try:
            raw = bytes(u2b[c] for c in t).decode("utf-8")
        except UnicodeDecodeError:
            continue  # no text has these bytes
        if [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(raw)] == [t]:
            raise ReleaseError(f"special token {t!r} (id {i}) is the byte-level spelling of the text {raw!r}, one "
                               "whole piece of the split; a Hugging Face tokenizer would give the special's id for "
                               "that text: rename the special")


def hf_tokenizer(enc):
    """A ``tokenizers.Tokenizer`` that gives exactly ``enc.encode(text, allowed_special="all")``.

    Byte-level BPE with the merges recovered from the ranks; the split is the encoding's own regex (Oniguruma
    supports its possessive quantifiers); whole pieces found in the vocabulary are taken as one token before
    any merge (``ignore_merges``), as tiktoken does; special tokens keep Kiln's ids wherever they are
    (``special_layout``).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    b2u = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(b2u[b] for b in token)

    ranks: dict[bytes, int] = enc._mergeable_ranks
    vocab = {text(t): r for t, r in ranks.items()}
    inner, after = special_layout(enc, vocab)
    merges = [(text(a), text(b)) for a, b in recover_merges(ranks)]
    tok = Tokenizer(BPE(vocab={**vocab, **dict(inner)}, merges=merges, ignore_merges=True, fuse_unk=False,
                        byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    _check_unreachable(tok, inner)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in inner + after])
    got = {t: tok.token_to_id(t) for t, _ in inner + after}
    if got != enc._special_tokens:  # what tokenizers numbered differs from Kiln's ids
        raise ReleaseError(f"special tokens {enc._special_tokens} came out as {got} in the Hugging Face tokenizer")
    return tok


def check_hf_tokenizer(enc, tok, texts=PROBE_TEXTS) -> None:
    """Raise ReleaseError naming the first text that ``tok`` splits differently from ``enc``."""
    for t in texts:
        want, got = enc.encode(t, allowed_special="all"), tok.encode(t).ids
        if want != got:
            raise ReleaseError(f"Hugging Face tokenizer differs from Kiln's on {t!r}: {got[:12]} vs {want[:12]}")


def uses_gpt2_split(enc) -> bool:
    """True when ``enc`` splits text with GPT-2's pattern, which GPT2Tokenizer's vocab.json/merges.txt reproduce."""
    from kiln.tokens.tokenizer import GPT2_PAT_STR

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
        "clean_up_tokenization_spaces": False, "added_tokens_decoder": added,
        "chat_template": chat_template(enc) or CHAT_TEMPLATE,
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
