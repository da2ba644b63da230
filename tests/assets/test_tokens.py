"""The tokenizer and token_shards assets, invoked directly: compression report for both vocabularies, the corpus
round trip through the shards, and publishing to a real S3-compatible server with a verified local cache.

Run: python -m pytest tests/assets/test_tokens.py -q  (GPT-2's files: fetched once into $KILN_SOURCE_CACHE or ~/.cache/kiln/sources)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import build_asset_context

from assets.tokens import TOKENIZER_HOLDOUT_PERMILLE, TokenizerConfig, TokenShardsConfig, token_shards, tokenizer
from kiln.tokens import store
from kiln.tokens.loader import TokenLoader
from kiln.tokens.shards import decode_documents, split_of
from kiln.tokens.tokenizer import DIGITS_PAT_STR, GPT4_PAT_STR, encoding_fingerprint, load_encoding, train_bpe
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource
from tests.kiln.tokens.test_store import s3_server

SOURCE_CACHE = os.environ.get("KILN_SOURCE_CACHE", str(Path.home() / ".cache/kiln/sources"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, docs) -> dict:
    """A clean_corpus output over the shared tiny documents (two row groups)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.parquet"
    table = pa.table({"id": [i for i, _ in docs], "text": [t for _, t in docs]})
    pq.write_table(table, path, row_group_size=300)
    return {"path": str(path), "version": "corpus-v1"}


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory) -> MlflowResource:
    d = tmp_path_factory.mktemp("mlflow")
    return MlflowResource(tracking_uri=f"sqlite:///{d / 'mlflow.db'}", artifact_root=str(d / "art"))


def run_tokenizer(storage: KilnStorageResource, mlflow: MlflowResource, corpus: dict, **config):
    with build_asset_context(resources={"storage": storage, "mlflow": mlflow}) as ctx:
        return tokenizer(ctx, TokenizerConfig(**config), clean_corpus=corpus)


def run_shards(storage: KilnStorageResource, mlflow: MlflowResource, corpus: dict, tok: dict, **config):
    with build_asset_context(resources={"storage": storage, "mlflow": mlflow}) as ctx:
        return token_shards(ctx, TokenShardsConfig(**config), clean_corpus=corpus, tokenizer=tok)


def test_tokenizer_reports_compression_of_both_vocabularies(tmp_path: Path, corpus: dict, docs, mlflow) -> None:
    storage = KilnStorageResource(root=str(tmp_path / "root"), source_cache=SOURCE_CACHE)
    out = run_tokenizer(storage, mlflow, corpus, vocab_size=300)
    value, meta = out.value, out.metadata
    held_out = [t for i, t in docs if split_of(i, TOKENIZER_HOLDOUT_PERMILLE) == "val"]
    n_bytes = sum(len(t.encode()) for t in held_out)
    enc = load_encoding(value["path"])
    trained = n_bytes / sum(len(enc.encode_ordinary(t)) for t in held_out)
    assert enc.n_vocab == value["n_vocab"] == 300 and value["kind"] == "bpe"
    assert value["compression"]["trained BPE (300)"] == pytest.approx(trained) == value["bytes_per_token"]
    gpt2 = value["compression"]["GPT-2 (50,257)"]
    assert meta["bytes_per_token_trained"].value == float(f"{trained:.4g}")  # metadata is rounded for people
    assert meta["bytes_per_token_gpt2"].value == float(f"{gpt2:.4g}")
    assert 1.0 < trained < gpt2 < 8.0  # 50k merges compress this English better than 44
    assert meta["heldout_documents"].value == len(held_out) > 10
    table = meta["compression"].value
    assert "trained BPE (300)" in table and "GPT-2 (50,257)" in table and f"{len(held_out)} held-out documents" in table
    assert value["url"] == str(Path(value["path"]).parent)  # local root: the folder is the durable copy

    alone = run_tokenizer(storage, mlflow, corpus, vocab_size=300, compare=False)
    assert list(alone.value["compression"]) == ["trained BPE (300)"] and alone.value["version"] == value["version"]
    g = run_tokenizer(storage, mlflow, corpus, kind="gpt2", vocab_size=300)
    assert g.value["n_vocab"] == 50259 and g.value["bytes_per_token"] == pytest.approx(gpt2)
    assert g.value["compression"]["trained BPE (300)"] == pytest.approx(trained)
    with pytest.raises(ValueError, match="tokenizer.kind must be 'bpe' or 'gpt2', not 'wordpiece'"):
        run_tokenizer(storage, mlflow, corpus, kind="wordpiece")


def test_split_digits_is_in_the_pattern_the_version_and_the_launchpad(tmp_path: Path, corpus: dict, docs, mlflow) -> None:
    field = tokenizer.op.config_schema.config_type.fields["split_digits"]  # what the launchpad shows
    assert field.default_value is True and r"number rule \p{N}, not GPT-4's \p{N}{1,3}" in field.description
    storage = KilnStorageResource(root=str(tmp_path / "root"))
    digits = run_tokenizer(storage, mlflow, corpus, vocab_size=300, compare=False, split_digits=True)
    merged = run_tokenizer(storage, mlflow, corpus, vocab_size=300, compare=False, split_digits=False)
    d, m = load_encoding(digits.value["path"]), load_encoding(merged.value["path"])
    assert (d._pat_str, m._pat_str) == (DIGITS_PAT_STR, GPT4_PAT_STR)
    assert digits.metadata["split_pattern"].value == DIGITS_PAT_STR and d.name == "kiln-bpe-300-digits"
    assert digits.value["version"] != merged.value["version"] and digits.value["fingerprint"] != merged.value["fingerprint"]
    trained_on = [t for i, t in docs if split_of(i, TOKENIZER_HOLDOUT_PERMILLE) == "train"]
    assert merged.value["fingerprint"] == encoding_fingerprint(train_bpe(trained_on, 300))  # false: today's tokenizer
    ids = d.encode_ordinary("12345 + 678 = 13023")
    assert [d.decode([i]) for i in ids if d.decode([i]).strip().isdigit()] == list("12345678" "13023")
    assert d.decode(ids) == "12345 + 678 = 13023"


def test_the_demo_splits_digits_and_the_frozen_presets_keep_the_gpt4_pattern() -> None:
    from jobs.presets import load_preset

    tok = lambda preset: load_preset(preset)["ops"].get("tokenizer", {}).get("config", {})  # noqa: E731
    for preset in ("smoke", "llama-tiny", "moe-tiny"):  # tests/data/smoke_frozen*.json freeze their tokens
        assert tok(preset)["split_digits"] is False, preset
    assert "split_digits" not in tok("demo") and TokenizerConfig(**tok("demo")).split_digits is True  # the default


def test_token_shards_round_trip_locally(tmp_path: Path, corpus: dict, docs, mlflow) -> None:
    storage = KilnStorageResource(root=str(tmp_path / "root"))
    tok = run_tokenizer(storage, mlflow, corpus, vocab_size=300, compare=False).value
    out = run_shards(storage, mlflow, corpus, tok, shard_tokens=4000, val_permille=100)
    value = out.value
    enc = load_encoding(tok["path"])
    for split in ("train", "val"):
        assert decode_documents(enc, value[split]) == [t for i, t in docs if split_of(i, 100) == split]
    assert value["url"] == value["dir"] and out.metadata["uploaded_mb"].value == 0
    assert len(value["train"]) > 2 and value["totals"]["val"]["documents"] > 20
    assert (Path(value["dir"]) / ".verified.json").exists()  # read back once; loaders only stat from now on


def test_token_shards_published_to_s3_and_read_through_a_verified_cache(tmp_path: Path, corpus: dict, docs, mlflow) -> None:
    with s3_server(tmp_path / "moto.log") as options:
        fs, _ = store.filesystem("s3://kiln-assets", options)
        fs.mkdir("kiln-assets")
        storage = KilnStorageResource(root="s3://kiln-assets/runs/a", cache=str(tmp_path / "cache"), storage_options=options)
        tok = run_tokenizer(storage, mlflow, corpus, vocab_size=300, compare=False).value
        assert tok["url"] == f"s3://kiln-assets/runs/a/tokenizer/{tok['version']}"
        assert fs.exists(f"kiln-assets/runs/a/tokenizer/{tok['version']}/tokenizer.json")
        out = run_shards(storage, mlflow, corpus, tok, shard_tokens=4000, val_permille=100)
        value, version = out.value, out.value["version"]
        assert value["url"] == f"s3://kiln-assets/runs/a/token_shards/{version}"
        assert value["dir"] == str(tmp_path / "cache" / "token_shards" / version)
        fs.invalidate_cache()
        remote = sorted(p.rsplit("/", 1)[1] for p in fs.find(f"kiln-assets/runs/a/token_shards/{version}"))
        assert remote == sorted(["manifest.json", *(Path(p).name for p in value["train"] + value["val"])])
        assert out.metadata["uploaded_mb"].value > 0

        shutil.rmtree(tmp_path / "cache")  # training on a machine without the hot copy
        files = storage.local_shards(value)
        assert files == {"train": value["train"], "val": value["val"]}
        durable_tok = tmp_path / "tokenizer.json"
        durable_tok.write_bytes(fs.cat_file(f"kiln-assets/runs/a/tokenizer/{tok['version']}/tokenizer.json"))
        enc = load_encoding(durable_tok)
        assert decode_documents(enc, files["train"]) == [t for i, t in docs if split_of(i, 100) == "train"]
        x, y = TokenLoader(files["train"], 4, 32, seed=1).next_batch()
        assert x.shape == (4, 32)

        # recompute (no run reuse) to check that publishing is idempotent
        no_reuse = MlflowResource(tracking_uri=mlflow.tracking_uri, artifact_root=mlflow.artifact_root, reuse_runs=False)
        again = run_shards(storage, no_reuse, corpus, tok, shard_tokens=4000, val_permille=100)
        assert again.value["version"] == version and again.metadata["uploaded_mb"].value == 0  # already published
