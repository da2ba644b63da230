"""A Hugging Face ``tokenizer.json`` (byte-level BPE: GPT-2, Llama 3, Qwen 2, SmolLM style) as Kiln's tiktoken encoding.

``encoding_from_hf(path)`` keeps every id (vocabulary and added tokens) and adds Kiln's chat tokens that are missing
(<|endoftext|>, <|user|>, <|assistant|>) after the highest id; ``check_same_ids(enc, path, texts)`` compares it with
``tokenizers``. A tokenizer that tiktoken cannot reproduce is refused, naming the part (model, normalizer, split).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import tiktoken

from kiln.pretrained.config import PretrainedError
from kiln.release.hf import PROBE_TEXTS, bytes_to_unicode
from kiln.tokens.tokenizer import GPT2_PAT_STR, SPECIAL_TOKENS

# GPT-2's split with each digit (or run of digits) its own piece first, as Sequence[Digits, ByteLevel(use_regex)]
# does (SmolLM): a space run now also ends before a digit, the end of its piece.
DIGITS_PAT = r"""{digits}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{{L}}+| ?[^\s\p{{L}}\p{{N}}]+|\s+(?![^\s\p{{N}}])|\s+"""
NORMALIZERS_KEPT = ("NFC",)  # Kiln's clean corpus is NFC text already; any other normalizer changes ids


@dataclass
class ImportedTokenizer:
    encoding: tiktoken.Encoding
    imported_vocab: int  # ids below this are the Hugging Face tokenizer's own (vocabulary and added tokens)
    added: dict[str, int] = field(default_factory=dict)  # Kiln chat tokens appended after it, by id
    notes: list[str] = field(default_factory=list)  # what differs from the Hugging Face tokenizer's behaviour
    bytes_added: dict[int, int] = field(default_factory=dict)  # byte values the vocabulary lacks -> the ids they got

    @property
    def new_ids(self) -> list[int]:
        """Every id past the imported vocabulary: the byte tokens it lacked, then Kiln's chat tokens."""
        return sorted([*self.bytes_added.values(), *self.added.values()])


def _kind(node: dict | None) -> str:
    return (node or {}).get("type", "none")


def _byte_level(node: dict, path: Path) -> bool:
    """Check a ByteLevel pre-tokenizer Kiln can reproduce; return its use_regex."""
    if node.get("add_prefix_space"):
        raise PretrainedError(f"{path}: pre_tokenizer ByteLevel add_prefix_space=true is not supported (tiktoken "
                              "adds no leading space); use a tokenizer without it")
    return bool(node.get("use_regex", True))


def split_pattern(pre: dict | None, path: Path) -> str:
    """The tiktoken split regex equal to a byte-level pre-tokenizer: GPT-2's ByteLevel, Split(regex) + ByteLevel
    (Llama 3, Qwen 2), or Digits + ByteLevel (SmolLM)."""
    parts = (pre or {}).get("pretokenizers") if _kind(pre) == "Sequence" else [pre] if pre else []
    kinds = [_kind(p) for p in parts]
    if kinds == ["ByteLevel"] and _byte_level(parts[0], path):
        return GPT2_PAT_STR
    if kinds == ["Split", "ByteLevel"] and not _byte_level(parts[1], path):
        split = parts[0]
        regex = (split.get("pattern") or {}).get("Regex")
        if regex and split.get("behavior") == "Isolated" and not split.get("invert"):
            return regex
    if kinds == ["Digits", "ByteLevel"] and _byte_level(parts[1], path):
        return DIGITS_PAT.format(digits=r"\p{N}" if parts[0].get("individual_digits") else r"\p{N}+")
    raise PretrainedError(f"{path}: pre_tokenizer {' + '.join(kinds) or 'none'} is not supported; Kiln imports "
                          "byte-level BPE split by ByteLevel, Split(regex, Isolated) + ByteLevel, or Digits + ByteLevel")


def _check_model(doc: dict, path: Path) -> dict:
    model = doc.get("model") or {}
    if model.get("type") != "BPE":
        raise PretrainedError(f"{path}: model type {model.get('type')!r} is not supported; Kiln imports byte-level "
                              "BPE tokenizers only (WordPiece, Unigram and SentencePiece-style models are not)")
    for key in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise PretrainedError(f"{path}: BPE {key}={model[key]!r} is not supported (byte-level BPE has none)")
    norm = doc.get("normalizer")
    if norm is not None and _kind(norm) not in NORMALIZERS_KEPT:
        raise PretrainedError(f"{path}: normalizer {_kind(norm)} is not supported; tiktoken cannot apply it, so "
                              "Kiln's ids would differ")
    if doc.get("decoder") is not None and _kind(doc["decoder"]) != "ByteLevel":
        raise PretrainedError(f"{path}: decoder {_kind(doc['decoder'])} is not byte-level; Kiln imports byte-level BPE")
    return model


def _ranks(model: dict, added_ids: set[int], path: Path) -> tuple[dict[bytes, int], list[int]]:
    """(mergeable ranks (token bytes -> id), the byte values with no token), checked to give what the merges give:
    every multi-byte token made by a merge, and merges in id order (tiktoken merges by the merged token's id)."""
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {}
    for text, i in model["vocab"].items():
        if i in added_ids:
            continue
        try:
            ranks[bytes(u2b[c] for c in text)] = i
        except KeyError as e:
            raise PretrainedError(f"{path}: token {text!r} (id {i}) is not written in byte-level characters; "
                                  "not a byte-level BPE vocabulary") from e
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    merged, last = set(), -1
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        tok = bytes(u2b[c] for c in a + b)
        r = ranks.get(tok)
        if r is None:
            raise PretrainedError(f"{path}: merge {a!r} + {b!r} makes a token not in the vocabulary")
        if tok in merged:
            continue
        if r < last:
            raise PretrainedError(f"{path}: merge {a!r} + {b!r} (id {r}) comes after a merge of a higher id; tiktoken "
                                  "ranks merges by token id, so this vocabulary cannot be reproduced")
        merged.add(tok)
        last = r
    unmade = [t for t in ranks if len(t) > 1 and t not in merged]
    if unmade:
        raise PretrainedError(f"{path}: token {unmade[0]!r} ({len(unmade)} such) is no merge's result; tiktoken could "
                              "produce it where the Hugging Face tokenizer does not")
    return ranks, missing


def _specials(doc: dict, path: Path) -> dict[str, int]:
    out = {}
    for t in doc.get("added_tokens") or []:
        for flag in ("lstrip", "rstrip", "single_word"):
            if t.get(flag):
                raise PretrainedError(f"{path}: added token {t['content']!r} has {flag}=true, which Kiln cannot "
                                      "reproduce; remove the flag or the token")
        out[t["content"]] = int(t["id"])
    return out


def read_tokenizer_json(path: Path) -> dict:
    """The parsed tokenizer.json at ``path``; PretrainedError naming it when missing or not JSON."""
    path = Path(path)
    if not path.is_file():
        raise PretrainedError(f"{path}: missing; Kiln imports a model with its tokenizer.json (a 'fast' tokenizer: "
                              "AutoTokenizer.from_pretrained(...).save_pretrained(folder) writes one)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PretrainedError(f"{path}: not readable JSON ({e})") from e


def encoding_from_hf(path: Path, name: str = "", doc: dict | None = None) -> ImportedTokenizer:
    """Kiln's encoding of a ``tokenizer.json`` (read from ``path``, or given as ``doc`` with ``path`` naming where it
    came from): the same ids for every token, added tokens as specials, and Kiln's missing chat tokens appended
    after the highest id."""
    path = Path(path)
    if doc is None:
        doc = read_tokenizer_json(path)
    model = _check_model(doc, path)
    pat = split_pattern(doc.get("pre_tokenizer"), path)
    specials = _specials(doc, path)
    ranks, missing = _ranks(model, set(specials.values()), path)
    n = max([*ranks.values(), *specials.values()]) + 1
    # tiktoken encodes any byte, so a byte the vocabulary lacks (SmolLM2 has no token for 21 control bytes; its
    # tokenizer drops them) gets a token of its own after the vocabulary, as Kiln's chat tokens do
    bytes_added = {b: n + i for i, b in enumerate(missing)}
    ranks.update({bytes([b]): i for b, i in bytes_added.items()})
    added = {t: n + len(missing) + i for i, t in enumerate(t for t in SPECIAL_TOKENS if t not in specials)}
    try:
        enc = tiktoken.Encoding(name=name or f"hf-{path.parent.name}", pat_str=pat, mergeable_ranks=ranks,
                                special_tokens={**specials, **added})
    except ValueError as e:
        raise PretrainedError(f"{path}: tiktoken refuses the vocabulary ({e})") from e
    notes = [f"normalizer {_kind(doc['normalizer'])}: Kiln encodes text as given (its clean corpus is NFC already)"
             for _ in [0] if doc.get("normalizer")]
    if missing:
        notes.append(f"{len(missing)} byte values have no token in the vocabulary ({', '.join(f'0x{b:02x}' for b in missing[:8])}"
                     f"{', ...' if len(missing) > 8 else ''}); Kiln gives them ids {n}..{n + len(missing) - 1} (the Hugging "
                     "Face tokenizer drops them)")
    if _kind(doc.get("post_processor")) == "TemplateProcessing":
        notes.append("post_processor adds tokens around each text in transformers; Kiln adds none "
                     "(documents are separated by <|endoftext|>)")
    return ImportedTokenizer(enc, n, added, notes, bytes_added)


def check_same_ids(imported: ImportedTokenizer, path: Path, texts: Iterable[str] = (), doc: dict | None = None) -> int:
    """Encode ``texts`` (plus probe texts and every special token) with Kiln's encoding and with ``tokenizers`` (the
    tokenizer.json at ``path``, or ``doc``); raise naming the first text whose ids differ. Returns how many texts were
    compared."""
    import unicodedata

    from tokenizers import Tokenizer

    enc = imported.encoding
    hf = Tokenizer.from_str(json.dumps(doc)) if doc is not None else Tokenizer.from_file(str(path))
    own = {t for t, i in enc._special_tokens.items() if i < imported.imported_vocab}
    probes = [*PROBE_TEXTS, *(f"a{t}b {t}" for t in sorted(own)), *texts]
    for text in probes:
        text = unicodedata.normalize("NFC", text)
        want, got = hf.encode(text, add_special_tokens=False).ids, enc.encode(text, allowed_special=own, disallowed_special=())
        if want != got:
            raise PretrainedError(f"{path}: Kiln's encoding differs from the Hugging Face tokenizer on {text[:60]!r}: "
                                  f"{got[:12]} vs {want[:12]}; this tokenizer cannot be imported exactly")
    return len(probes)
