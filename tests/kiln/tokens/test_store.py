"""Tests for kiln.tokens.store against a real S3-compatible server (moto's, started on a free 127.0.0.1 port) and a plain folder.

Run: python -m pytest tests/kiln/tokens/test_store.py -q
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from kiln.tokens import store
from kiln.tokens.loader import TokenLoader
from kiln.tokens.shards import MANIFEST, ShardError, shard_paths, verify_shards, write_shards
from ports import free_port


@contextlib.contextmanager
def s3_server(log: Path) -> Iterator[dict]:
    """moto's S3 server as a subprocess on a free port; yields the s3fs options that reach it."""
    for _ in range(3):  # the port could be taken between choosing and binding it
        port = free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                    stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.1)
        if proc.poll() is None and time.monotonic() < deadline:
            break
        proc.kill()
        proc.wait()
    else:
        raise RuntimeError(f"moto S3 server did not start; see {log}")
    try:
        yield {"endpoint_url": f"http://127.0.0.1:{port}", "key": "kiln-test", "secret": "kiln-test"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[dict]:
    with s3_server(tmp_path_factory.mktemp("moto") / "server.log") as options:
        fs, _ = store.filesystem("s3://kiln-test", options)
        fs.mkdir("kiln-test")
        yield options


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory, tiny_tokenizer, docs) -> Path:
    """A finished shard folder: 3+ train shards, 2+ val shards."""
    enc, _ = tiny_tokenizer
    out = tmp_path_factory.mktemp("published") / "v1"
    write_shards(enc, docs, out, 3000, 200, 1)
    return out


def remote(options: dict, url: str):
    fs, path = store.filesystem(url, options)
    fs.invalidate_cache()
    return fs, path


def test_publish_then_fetch_round_trip(s3: dict, local_shards: Path, tmp_path: Path) -> None:
    url = "s3://kiln-test/kiln/token_shards/v1"
    files = sorted(p.name for p in local_shards.iterdir() if not p.name.startswith("."))
    res = store.publish_dir(local_shards, url, s3)
    assert res.files == len(files) and res.bytes == sum((local_shards / f).stat().st_size for f in files)
    fs, path = remote(s3, url)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(path)) == files
    assert fs.cat_file(f"{path}/{MANIFEST}") == (local_shards / MANIFEST).read_bytes()
    assert store.publish_dir(local_shards, url, s3).files == 0  # already complete: nothing uploaded

    cache = tmp_path / "cache"
    got = store.fetch_shards(url, cache, s3)
    n_shards = len(files) - 1
    assert len(got.fetched) == n_shards and not got.hits and got.fetched_bytes > 0
    for f in files:
        assert (cache / f).read_bytes() == (local_shards / f).read_bytes()
    again = store.fetch_shards(url, cache, s3)
    assert not again.fetched and len(again.hits) == n_shards  # warm cache: nothing downloaded

    a = TokenLoader(shard_paths(local_shards, "train"), 4, 16, seed=3)
    b = TokenLoader(shard_paths(cache, "train"), 4, 16, seed=3)
    for _ in range(5):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])


def test_fetch_one_split_and_heal_a_bad_cached_shard(s3: dict, local_shards: Path, tmp_path: Path) -> None:
    url = "s3://kiln-test/kiln/token_shards/split"
    store.publish_dir(local_shards, url, s3)
    cache = tmp_path / "cache"
    got = store.fetch_shards(url, cache, s3, splits=["val"])
    val = [p.name for p in shard_paths(local_shards, "val")]
    assert got.fetched == val and sorted(p.name for p in cache.glob("*.bin")) == val
    bad = cache / val[0]
    data = bytearray(bad.read_bytes())
    data[-2] ^= 0xFF
    bad.write_bytes(bytes(data))
    healed = store.fetch_shards(url, cache, s3, splits=["val"])
    assert healed.fetched == [val[0]] and healed.hits == val[1:]
    assert bad.read_bytes() == (local_shards / val[0]).read_bytes()
    verify_shards(cache, val)


def test_bad_durable_copies_are_named(s3: dict, local_shards: Path, tmp_path: Path) -> None:
    url = "s3://kiln-test/kiln/token_shards/bad"
    store.publish_dir(local_shards, url, s3)
    fs, path = remote(s3, url)
    first = shard_paths(local_shards, "train")[1].name
    data = bytearray(fs.cat_file(f"{path}/{first}"))
    data[1500] ^= 0xFF
    fs.pipe_file(f"{path}/{first}", bytes(data))
    with pytest.raises(ShardError, match=rf"shard {url}/{first}: checksum mismatch.*durable copy is corrupt"):
        store.fetch_shards(url, tmp_path / "c1", s3)
    assert not (tmp_path / "c1" / first).exists() and not (tmp_path / "c1" / MANIFEST).exists()
    fs.rm_file(f"{path}/{first}")
    with pytest.raises(ShardError, match=rf"shard {url}/{first} named in {url}/manifest.json is missing"):
        store.fetch_shards(url, tmp_path / "c2", s3)
    with pytest.raises(ShardError, match=r"no shard manifest at s3://kiln-test/kiln/nothing/manifest\.json"):
        store.fetch_shards("s3://kiln-test/kiln/nothing", tmp_path / "c3", s3)

    other = tmp_path / "other"
    other.mkdir()
    (other / MANIFEST).write_text('{"shards": []}')
    with pytest.raises(store.StoreError, match=rf"{url}/manifest.json already exists with other content"):
        store.publish_dir(other, url, s3)
    with pytest.raises(store.StoreError, match="has no manifest.json"):
        store.publish_dir(tmp_path / "c3", "s3://kiln-test/x", s3)


def test_interrupted_publish_is_not_served_and_is_completed(s3: dict, local_shards: Path, tmp_path: Path) -> None:
    url = "s3://kiln-test/kiln/token_shards/partial"
    fs, path = remote(s3, url)
    some = shard_paths(local_shards, "train")[0]
    fs.put_file(str(some), f"{path}/{some.name}")  # a crash after one shard: no manifest
    with pytest.raises(ShardError, match="no shard manifest"):
        store.fetch_shards(url, tmp_path / "c", s3)
    assert store.publish_dir(local_shards, url, s3).files > 1
    assert not store.fetch_shards(url, tmp_path / "c", s3).hits


def test_plain_folder_and_file_url_as_durable_root(local_shards: Path, tmp_path: Path) -> None:
    for url in (str(tmp_path / "mnt" / "v1"), (tmp_path / "url" / "v1").as_uri()):
        store.publish_dir(local_shards, url, None)
        got = store.fetch_shards(url, tmp_path / f"cache-{len(url)}", None)
        assert len(got.fetched) == len(list(local_shards.glob("*.bin")))
    same = store.fetch_shards(str(local_shards), local_shards)  # the root itself: verified in place
    assert not same.fetched and len(same.hits) == len(list(local_shards.glob("*.bin")))
    tok = tmp_path / "tok"
    (tok / "sub").mkdir(parents=True)
    (tok / "tokenizer.json").write_text("{}")
    (tok / "sub" / "notes.txt").write_text("n")
    url = (tmp_path / "durable-tok").as_uri()
    store.publish_dir(tok, url, last="tokenizer.json")
    back = store.fetch_dir(url, tmp_path / "tok-copy", last="tokenizer.json")
    assert (back / "sub" / "notes.txt").read_text() == "n" and (back / "tokenizer.json").read_text() == "{}"
    with pytest.raises(store.StoreError, match=r"no complete copy at .*nothing: .*nothing/tokenizer\.json is missing"):
        store.fetch_dir((tmp_path / "nothing").as_uri(), tmp_path / "x", last="tokenizer.json")
    with pytest.raises(store.StoreError, match="cannot open storage location nosuchproto://x"):
        store.filesystem("nosuchproto://x")


def test_command_line(s3: dict, local_shards: Path, tmp_path: Path, capsys) -> None:
    url = "s3://kiln-test/kiln/cli"
    opts = [f"--option=endpoint_url={s3['endpoint_url']}", "--option=key=kiln-test", "--option=secret=kiln-test"]
    store.main(["publish", str(local_shards), url, *opts])
    store.main(["fetch", url, str(tmp_path / "c"), "--split", "train", *opts])
    out = capsys.readouterr().out
    assert f"{url}: uploaded" in out and "0 cached" in out and "all verified" in out
    assert sorted(p.name for p in (tmp_path / "c").glob("*.bin")) == [p.name for p in shard_paths(local_shards, "train")]
