"""Tests for kiln.tokens.shards: llm.c header bytes, round trips, uint32 path, checksum/truncation errors, split stability,
the table of shards.

Run: python -m pytest tests/kiln/tokens/test_shards.py -q
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from kiln.tokens import shards as sh
from kiln.common.files import sha256_file
from kiln.tokens.tokenizer import encoding_fingerprint, train_bpe


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    from pydoc_data.topics import topics

    return train_bpe(list(topics.values())[:20], 400)


def random_docs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x17F), (0x391, 0x3C9), (0x4E00, 0x4E80), (0x1F600, 0x1F64F), (0x300, 0x36F)]
    docs = []
    for i in range(n):
        chars = []
        for _ in range(rng.randint(0, 200)):
            lo, hi = rng.choice(ranges)
            chars.append(rng.choice(["\n", " ", "\t", "<|endoftext|>"]) if rng.random() < 0.08 else chr(rng.randint(lo, hi)))
        docs.append((f"doc-{seed}-{i}", "".join(chars)))
    return docs


def by_split(docs: list[tuple[str, str]], permille: int, split: str) -> list[str]:
    return [t for i, t in docs if sh.split_of(i, permille) == split]


def test_header_bytes_and_tokens(enc: tiktoken.Encoding, tmp_path: Path) -> None:
    m = sh.write_shards(enc, [("a", "hello world"), ("b", "bye")], tmp_path, 1000, 0, 1)
    raw = (tmp_path / "train_000000.bin").read_bytes()
    expected = [enc.eot_token, *enc.encode_ordinary("hello world"), enc.eot_token, *enc.encode_ordinary("bye")]
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[:3].tolist() == [20240520, 1, len(expected)] and not header[3:].any()
    assert raw[:12] == (20240520).to_bytes(4, "little") + (1).to_bytes(4, "little") + len(expected).to_bytes(4, "little")
    assert len(raw) == 1024 + 2 * len(expected)
    assert np.frombuffer(raw[1024:], dtype="<u2").tolist() == expected
    assert m["shards"] == [{"file": "train_000000.bin", "split": "train", "tokens": len(expected), "bytes": len(raw),
                            "sha256": sha256_file(tmp_path / "train_000000.bin"), "documents": 2}]
    assert m["dtype"] == "uint16" and m["vocab_size"] == 400 and m["encoding_fingerprint"] == encoding_fingerprint(enc)
    assert sh.load_manifest(tmp_path) == m
    assert sh.read_shard(tmp_path / "train_000000.bin").tolist() == expected
    assert sh.shard_table(m) == [{"file": "train_000000.bin", "split": "train", "tokens": len(expected), "documents": 2,
                                  "sha256": sha256_file(tmp_path / "train_000000.bin")[:16]}]


@pytest.mark.parametrize("workers,executor", [(1, "thread"), (2, "thread"), (2, "process")])
def test_round_trip_random_unicode(enc: tiktoken.Encoding, tmp_path: Path, workers: int, executor: str) -> None:
    docs = random_docs(300)
    seen: list[tuple[int, int]] = []
    m = sh.write_shards(enc, docs, tmp_path, 997, 200, workers, progress=lambda d, t: seen.append((d, t)), executor=executor)
    assert sh.verify_shards(tmp_path) == m
    for split in sh.SPLITS:
        expected = by_split(docs, 200, split)
        paths = sh.shard_paths(tmp_path, split)
        assert sh.decode_documents(enc, paths) == expected
        assert m["documents"][split] == m["splits"][split]["documents"] == len(expected)
        stream = np.concatenate([sh.read_shard(p) for p in paths]).tolist()
        assert stream == [tok for t in expected for tok in [enc.eot_token, *enc.encode_ordinary(t)]]  # same ids as encode_ordinary
        assert m["splits"][split]["tokens"] == len(stream)
        assert [s["tokens"] for s in m["shards"] if s["split"] == split][:-1] == [997] * (len(paths) - 1)
        assert [p.name for p in paths] == [f"{split}_{i:06d}.bin" for i in range(len(paths))]
    assert seen[-1] == (300, m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"])
    assert 30 <= m["documents"]["val"] <= 90  # ~20 % of 300


def test_uint32_when_vocab_is_big(enc: tiktoken.Encoding, tmp_path: Path) -> None:
    big = tiktoken.Encoding(name="big", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                            special_tokens={"<|endoftext|>": 70000})
    docs = random_docs(20, seed=3)
    m = sh.write_shards(big, docs, tmp_path / "auto", 300, 0, 1)
    first = tmp_path / "auto" / "train_000000.bin"
    assert m["dtype"] == "uint32" and m["version"] == 2
    assert np.fromfile(first, dtype="<i4", count=3).tolist() == [20240520, 2, 300]
    assert first.stat().st_size == 1024 + 4 * 300
    assert sh.read_shard(first)[0] == 70000
    assert sh.decode_documents(big, sh.shard_paths(tmp_path / "auto", "train")) == [t for _, t in docs]
    with pytest.raises(sh.ShardError, match=r"forced: vocabulary of encoding 'big' \(70001 tokens, largest id 70000\) is larger than uint16"):
        sh.write_shards(big, docs, tmp_path / "forced", 300, 0, 1, dtype="uint16")
    m = sh.write_shards(enc, docs, tmp_path / "u32", 300, 0, 1, dtype="uint32")  # forced wide dtype
    assert m["dtype"] == "uint32" and sh.decode_documents(enc, sh.shard_paths(tmp_path / "u32", "train")) == [t for _, t in docs]
    small = sh.write_shards(enc, docs, tmp_path / "u16", 300, 0, 1)
    with pytest.raises(sh.ShardError, match="70001 tokens is larger than its uint16"):
        sh.read_shard(tmp_path / "u16" / small["shards"][0]["file"], vocab_size=70001)


def test_corruption_errors(enc: tiktoken.Encoding, tmp_path: Path) -> None:
    m = sh.write_shards(enc, random_docs(50, seed=1), tmp_path, 500, 0, 1)
    path = tmp_path / "train_000001.bin"
    entry = m["shards"][1]
    data = bytearray(path.read_bytes())
    data[2000] ^= 0xFF
    path.write_bytes(bytes(data))
    sh.read_shard(path)  # header still fine
    with pytest.raises(sh.ShardError, match="train_000001.bin: checksum mismatch"):
        sh.read_shard(path, entry["sha256"])
    with pytest.raises(sh.ShardError, match="checksum mismatch"):
        sh.verify_shards(tmp_path)
    path.write_bytes(bytes(data[:-1]))
    msg = r"train_000001.bin is truncated: header says 500 uint16 tokens = 2024 bytes, file has 2023"
    with pytest.raises(sh.ShardError, match=msg):
        sh.read_shard(path)
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(sh.ShardError, match="truncated: 100 bytes"):
        sh.read_shard(path)
    path.write_bytes(b"\0" * 8 + bytes(data[8:]))
    with pytest.raises(sh.ShardError, match="bad magic 0"):
        sh.read_shard(path)
    path.unlink()
    with pytest.raises(sh.ShardError, match="shard train_000001.bin named in .* is missing"):
        sh.verify_shards(tmp_path)
    (tmp_path / "manifest.json").write_text('{"shards": [')
    with pytest.raises(sh.ShardError, match="manifest.json"):
        sh.load_manifest(tmp_path)


def test_verified_shards_are_not_hashed_again(enc: tiktoken.Encoding, tmp_path: Path, monkeypatch) -> None:
    sh.write_shards(enc, random_docs(60, seed=2), tmp_path, 400, 0, 1)
    hashed: list[str] = []
    real = sh.sha256_file
    monkeypatch.setattr(sh, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    m = sh.verify_shards(tmp_path)
    n = len(m["shards"])
    assert n >= 3 and len(hashed) == n and (tmp_path / sh.VERIFIED).exists()
    sh.verify_shards(tmp_path)
    sh.check_shard_files(sh.shard_paths(tmp_path, "train"))
    assert len(hashed) == n  # unchanged files: stat only
    path = tmp_path / "train_000001.bin"
    data = bytearray(path.read_bytes())
    data[1500] ^= 0x01  # same size, new modification time
    path.write_bytes(bytes(data))
    with pytest.raises(sh.ShardError, match=r"train_000001\.bin: checksum mismatch"):
        sh.verify_shards(tmp_path)
    assert hashed[n:] == ["train_000001.bin"]


def test_bad_manifests_are_named(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text('{"shards": [{"file": "train_000000.bin", "split": "train"}]}')
    with pytest.raises(sh.ShardError, match=r"manifest\.json: shard entry .* lacks tokens, sha256"):
        sh.verify_shards(tmp_path)
    (tmp_path / "manifest.json").write_text('{"shards": [{"file": "train_000000.bin", "split": "train", "tokens": 3, "sha256": "00"}]}')
    with pytest.raises(sh.ShardError, match=r"shard train_000000\.bin named in .*manifest\.json is missing from"):
        sh.check_shard_files([tmp_path / "train_000000.bin"])
    with pytest.raises(sh.ShardError, match=r"cannot read shard manifest .*nowhere.*manifest\.json"):
        sh.load_manifest(tmp_path / "nowhere")


def test_split_stability_and_errors(enc: tiktoken.Encoding, tmp_path: Path) -> None:
    old = random_docs(400, seed=5)
    more = old + random_docs(400, seed=6)
    m1 = sh.write_shards(enc, old, tmp_path / "v1", 10_000, 100, 1)
    m2 = sh.write_shards(enc, more, tmp_path / "v2", 10_000, 100, 1)
    val1 = sh.decode_documents(enc, sh.shard_paths(tmp_path / "v1", "val"))
    val2 = sh.decode_documents(enc, sh.shard_paths(tmp_path / "v2", "val"))
    assert val2[: len(val1)] == val1 and m2["documents"]["val"] > m1["documents"]["val"] > 0
    assert sh.decode_documents(enc, sh.shard_paths(tmp_path / "v2", "train"))[: m1["documents"]["train"]] == \
        sh.decode_documents(enc, sh.shard_paths(tmp_path / "v1", "train"))
    assert sh.split_of("doc-5-0", 0) == "train" and sh.split_of("doc-5-0", 1000) == "val"
    with pytest.raises(sh.ShardError, match="no documents"):
        sh.write_shards(enc, [], tmp_path / "empty", 100, 10, 1)
    with pytest.raises(sh.ShardError, match="already holds shards"):
        sh.write_shards(enc, old, tmp_path / "v1", 100, 10, 1)


def test_a_byte_flipped_with_size_and_time_kept_is_found_only_by_the_full_check(enc: tiktoken.Encoding,
                                                                                 tmp_path: Path) -> None:
    import os

    sh.write_shards(enc, random_docs(60, seed=3), tmp_path, 400, 0, 1)
    paths = sh.shard_paths(tmp_path, "train")
    sh.check_shard_files(paths)  # hashed once and remembered
    path = paths[1]
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[1500] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot: the size and the time are what they were
    sh.check_shard_files(paths)  # the quick check cannot see it
    with pytest.raises(sh.DamagedShardError, match=rf"{path.name}: checksum mismatch") as e:
        sh.check_shard_files(paths, full=True)
    assert e.value.path == path and isinstance(e.value, sh.ShardError)
