"""kiln.pretrained: tiny random transformers models import with transformers' logits; bad folders are refused by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfmodels import corpus, hf_logits, save_tiny
from kiln.model.families import build_model
from kiln.pretrained.config import PretrainedError
from kiln.pretrained.source import folder_hash, import_pretrained, licence_of, load_pretrained
from kiln.train.checkpoint import load_state
from tests.kiln.pretrained.pretrained_kit import CASES, _copy


@pytest.mark.parametrize("arch,style,shards", CASES)
def test_imported_model_gives_transformers_logits(folders, arch, style, shards):
    state, cfg, tok, record = load_pretrained(folders[arch, style], corpus(40, seed=3))
    assert cfg.family == ("gpt2" if arch == "gpt2" else "llama") and cfg.qk_norm == (arch == "qwen3")
    model = build_model(cfg)
    model.load_state_dict(state)
    ids = torch.randint(0, record["imported_vocab"], (2, 24), generator=torch.Generator().manual_seed(0))
    want = hf_logits(folders[arch, style], ids)  # (B, T, V_hf)
    got = model.eval()(ids)  # (B, T, V_kiln)
    keep = [i for i in range(want.shape[-1]) if i not in set(tok.added.values())]
    torch.testing.assert_close(got[..., keep], want[..., keep], atol=1e-5, rtol=1e-5)
    assert record["weights"] == (sorted(p.name for p in folders[arch, style].glob("model-*.safetensors")) if shards
                                 else ["model.safetensors"])


def test_added_chat_tokens_start_as_the_mean_embedding(folders):
    state, cfg, tok, record = load_pretrained(folders["llama", "llama3"])
    assert set(tok.added) == {"<|endoftext|>", "<|user|>", "<|assistant|>"}  # Llama 3 has none of Kiln's three
    emb = state["model.embed_tokens.weight"]
    mean = emb[: tok.imported_vocab].mean(dim=0)
    for i in tok.added.values():
        torch.testing.assert_close(emb[i], mean)
        torch.testing.assert_close(state["lm_head.weight"][i], state["lm_head.weight"][: tok.imported_vocab].mean(0))
    assert tok.encoding.eot_token == tok.added["<|endoftext|>"] and cfg.vocab_size >= tok.encoding.n_vocab


def test_embedding_grows_when_the_added_tokens_do_not_fit(tmp_path):
    folder = save_tiny(tmp_path / "g", "gpt2", extra_rows=0)
    state, cfg, tok, record = load_pretrained(folder)
    assert cfg.vocab_size == record["imported_vocab"] + 2 == tok.encoding.n_vocab  # <|user|>, <|assistant|>
    assert state["transformer.wte.weight"].shape[0] == cfg.vocab_size
    assert state["lm_head.weight"] is state["transformer.wte.weight"]


def test_import_writes_a_checkpoint_that_records_its_source(folders, tmp_path):
    folder = folders["gpt2", "gpt2"]
    record = import_pretrained(folder, tmp_path / "out")
    state, meta = load_state(tmp_path / "out" / "checkpoints" / "step_0000000")
    assert meta["task"] == "import" and meta["pretrained"]["sha256"] == folder_hash(folder) == record["sha256"]
    assert record["license"] == "apache-2.0" and record["model_type"] == "gpt2"
    model = build_model(load_pretrained(folder)[1])
    model.load_state_dict(state["model"])
    assert (tmp_path / "out" / "checkpoints" / "step_0000000" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "out" / "pretrained.json").read_text())["checkpoint"] == "checkpoints/step_0000000"
    assert record["checkpoint"] == str(tmp_path / "out" / "checkpoints" / "step_0000000")


def test_folder_hash_follows_content(folders, tmp_path):
    copy = shutil.copytree(folders["gpt2", "gpt2"], tmp_path / "copy")
    assert folder_hash(copy) == folder_hash(folders["gpt2", "gpt2"])
    (copy / "README.md").write_text("changed")
    assert folder_hash(copy) != folder_hash(folders["gpt2", "gpt2"])


def test_licence_from_front_matter_config_or_file(tmp_path):
    (tmp_path / "README.md").write_text("---\nlanguage: en\nlicense: 'llama3.2'\n---\ntext\n")
    assert licence_of(tmp_path, {}) == "llama3.2"
    (tmp_path / "README.md").write_text("no front matter\nlicense: mit\n")
    assert licence_of(tmp_path, {"license": "mit"}) == "mit"
    assert licence_of(tmp_path, {}) == "unknown"
    (tmp_path / "LICENSE").write_text("terms")
    assert licence_of(tmp_path, {}) == "see LICENSE"


# ---- bad input: each error names the file and what to do


def test_vocabulary_larger_than_the_embedding(folders, tmp_path):
    bad = _copy(folders, tmp_path)
    doc = json.loads((bad / "config.json").read_text())
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["transformer.wte.weight"] = tensors["transformer.wte.weight"][:300].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text(json.dumps({**doc, "vocab_size": 300}))
    with pytest.raises(PretrainedError, match=r"tokenizer.json: 401 tokens but the embedding in .*config.json has 300 rows"):
        load_pretrained(bad)


def test_not_a_folder(tmp_path):
    with pytest.raises(PretrainedError, match=r"nowhere: not a folder"):
        load_pretrained(tmp_path / "nowhere")
