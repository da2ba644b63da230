"""kiln.pretrained.gguf: tiny GGUF files (gguf's own writer, several quantisation types) import with the logits and
greedy continuations of transformers' GGUF loader; damaged or unsupported files are refused naming the file and field."""

import struct

import pytest
import torch

from ggufmodels import CHAT_TEMPLATE, hf_gguf_logits, write_gguf
from hfmodels import corpus, hf_logits, save_tiny
from kiln.model.families import build_model
from kiln.model.generate import generate
from kiln.pretrained.config import PretrainedError
from kiln.pretrained.gguf import is_gguf, read_gguf
from kiln.pretrained.source import folder_hash, import_pretrained, load_pretrained, pretrained_architecture
from kiln.train.checkpoint import load_state

QTYPES = ("F32", "F16", "Q8_0", "Q4_1")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {(a, s): save_tiny(root / f"{a}-{s}", a, s) for a, s in [("llama", "smollm"), ("llama", "llama3"),
                                                                   ("qwen3", "qwen2")]}


@pytest.fixture(scope="module")
def files(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {q: write_gguf(hf["llama", "smollm"], root / f"smollm-{q}.gguf", q, style="smollm") for q in QTYPES}
    out["llama3"] = write_gguf(hf["llama", "llama3"], root / "llama3.gguf", "Q8_0", style="llama3")
    out["qwen3"] = write_gguf(hf["qwen3", "qwen2"], root / "qwen3.gguf", "F32", style="qwen2")
    return out


def kiln_model(path):
    state, cfg, tok, record = load_pretrained(path, corpus(30, seed=5))
    model = build_model(cfg)
    model.load_state_dict(state)
    return model.eval(), tok, record


@pytest.mark.parametrize("qtype", QTYPES)
def test_logits_equal_transformers_gguf_loader(files, qtype):
    model, tok, record = kiln_model(files[qtype])
    n = record["imported_vocab"]
    ids = torch.randint(0, n, (3, 40), generator=torch.Generator().manual_seed(1))
    want = hf_gguf_logits(files[qtype], ids)[..., :n]
    with torch.no_grad():
        got = model(ids)[..., :n]
    assert (got - want).abs().max().item() <= 1e-4
    expected = {"F32": {"F32": 21}, "F16": {"F16": 16, "F32": 5}, "Q8_0": {"Q8_0": 16, "F32": 5},
                "Q4_1": {"Q4_1": 16, "F32": 5}}[qtype]
    assert record["gguf"]["tensor_types"] == expected


def test_greedy_generation_equals_transformers_for_64_tokens(files):
    from transformers import AutoModelForCausalLM

    path = files["Q8_0"]
    model, tok, record = kiln_model(path)
    prompt = torch.tensor([tok.encoding.encode("the model reads text and")])
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, prompt.shape[1]:].tolist()
        got = generate(model, prompt, 64, temperature=0.0, n_vocab=record["imported_vocab"])[0, prompt.shape[1]:].tolist()
    assert len(want) == 64 and got == want


def test_llama3_split_and_unpermuted_queries(files, hf):
    model, tok, record = kiln_model(files["llama3"])
    assert record["gguf"]["tokenizer"]["pre"] == "llama-bpe"
    ids = torch.randint(0, record["imported_vocab"], (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # Q8_0 against the unquantised folder: the rounding alone, not a head order
        diff = (model(ids)[..., :record["imported_vocab"]] - hf_logits(hf["llama", "llama3"], ids)[..., :record["imported_vocab"]]).abs().max()
    assert diff < 0.05


def test_qwen3_is_not_permuted(files, hf):
    model, tok, record = kiln_model(files["qwen3"])
    n = record["imported_vocab"]
    ids = torch.randint(0, n, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :n], hf_logits(hf["qwen3", "qwen2"], ids)[..., :n], atol=1e-5, rtol=1e-5)
    assert record["model_type"] == "qwen3" and record["architectures"] == ["Qwen3ForCausalLM"]


def test_tokenizer_ids_equal_the_hugging_face_folder(files, hf):
    from tokenizers import Tokenizer

    _, tok, record = kiln_model(files["F32"])
    ref = Tokenizer.from_file(str(hf["llama", "smollm"] / "tokenizer.json"))
    for text in corpus(50, seed=9):
        assert tok.encoding.encode(text, disallowed_special=()) == ref.encode(text, add_special_tokens=False).ids
    assert record["gguf"]["tokenizer"]["pre"] == "smollm" and record["gguf"]["chat_template"] == CHAT_TEMPLATE


def test_record_names_the_file_its_hash_licence_and_types(files, tmp_path):
    path = files["Q4_1"]
    out = import_pretrained(path, tmp_path / "out")
    state, meta = load_state(tmp_path / "out" / "checkpoints" / "step_0000000")
    assert out["sha256"] == folder_hash(path) == read_gguf(path, weights=False).record["sha256"]
    assert meta["pretrained"]["gguf"]["file"] == path.name and out["license"] == "apache-2.0"
    assert out["gguf"]["gguf_version"] == 3 and out["weights"] == [path.name]
    cfg, tok = pretrained_architecture(path)  # metadata alone, as kiln plan reads it
    assert cfg.vocab_size == state["model"]["model.embed_tokens.weight"].shape[0]


def test_missing_byte_tokens_get_ids_after_the_vocabulary(hf, tmp_path):
    import json

    from tokenizers import Tokenizer

    folder = hf["llama", "smollm"]
    doc = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**doc["model"]["vocab"], **{t["content"]: t["id"] for t in doc["added_tokens"]}}
    specials = {t["id"] for t in doc["added_tokens"]}
    byte4 = doc["model"]["vocab"]["Ą"]  # byte 0x04 in byte-level characters
    # the file with the token of byte 0x04 marked unused, as SmolLM2's vocabulary lacks 21 bytes
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]  # past the vocabulary: [PAD] rows, unused
    types = [5 if i == byte4 or i > max(vocab.values()) else 3 if i in specials else 1 for i in range(rows)]
    path = write_gguf(folder, tmp_path / "nobyte.gguf", "F32", style="smollm",
                      meta_overrides={"tokenizer.ggml.token_type": types})
    state, cfg, tok, record = load_pretrained(path)
    assert tok.bytes_added == {4: tok.imported_vocab} and "0x04" in record["tokenizer_notes"][0]
    assert tok.encoding.encode("\x04") == [tok.imported_vocab]
    assert tok.encoding.decode(tok.encoding.encode("a\x04b")) == "a\x04b"
    hf_tok = Tokenizer.from_str(json.dumps(read_gguf(path, weights=False).tokenizer))
    assert hf_tok.encode("\x04", add_special_tokens=False).ids == []  # the Hugging Face tokenizer drops it
    emb = state["model.embed_tokens.weight"]
    torch.testing.assert_close(emb[tok.imported_vocab], emb[: tok.imported_vocab].mean(0))


# ---- bad input: one line naming the file and the field --------------------------------------------------------------

def test_truncated_file(files, tmp_path):
    bad = tmp_path / "cut.gguf"
    data = files["F32"].read_bytes()
    bad.write_bytes(data[: len(data) - 1000])
    with pytest.raises(PretrainedError, match=r"cut.gguf: .*truncated"):
        load_pretrained(bad)
    bad.write_bytes(data[:10])
    with pytest.raises(PretrainedError, match=r"cut.gguf: 10 bytes, shorter than a GGUF header"):
        load_pretrained(bad)


def test_wrong_magic_and_version(files, tmp_path):
    data = files["F32"].read_bytes()
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(PretrainedError, match=r"magic.gguf: magic b'GGML' is not b'GGUF'; not a GGUF file"):
        load_pretrained(bad)
    assert not is_gguf(bad)
    old = tmp_path / "v1.gguf"
    old.write_bytes(data[:4] + struct.pack("<I", 1) + data[8:])
    with pytest.raises(PretrainedError, match=r"v1.gguf: GGUF version 1 is not supported"):
        load_pretrained(old)


def test_unknown_architecture(hf, tmp_path):
    path = write_gguf(hf["llama", "smollm"], tmp_path / "arch.gguf", "F32", style="smollm")
    import gguf

    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "llama"  # the writer sets it; rewrite the string in place
    data = bytearray(path.read_bytes())
    i = data.index(b"general.architecture") + len("general.architecture") + 4 + 8
    assert data[i:i + 5] == b"llama"
    data[i:i + 5] = b"bloom"
    path.write_bytes(bytes(data))
    with pytest.raises(PretrainedError, match=r"arch.gguf: metadata general.architecture='bloom' is not supported; "
                                              r"Kiln imports llama, qwen3"):
        load_pretrained(path)


def test_shapes_that_disagree_with_the_metadata(hf, tmp_path):
    path = write_gguf(hf["llama", "smollm"], tmp_path / "shape.gguf", "F32", style="smollm",
                      meta_overrides={"llama.feed_forward_length": 48})
    with pytest.raises(PretrainedError, match=r"shape.gguf: tensor blk.0.ffn_\w+.weight has shape .* but the metadata "
                                              r"\(llama.\* keys\) implies"):
        load_pretrained(path)


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_missing_tokenizer_metadata(hf, tmp_path, key):
    path = write_gguf(hf["llama", "smollm"], tmp_path / "tok.gguf", "F32", style="smollm", skip=(key,))
    with pytest.raises(PretrainedError, match=rf"tok.gguf: metadata {key} is missing"):
        load_pretrained(path)


def test_sentencepiece_and_unknown_split_refused(hf, tmp_path):
    path = write_gguf(hf["llama", "smollm"], tmp_path / "sp.gguf", "F32", style="smollm",
                      meta_overrides={"tokenizer.ggml.model": "llama"})
    with pytest.raises(PretrainedError, match=r"sp.gguf: metadata tokenizer.ggml.model='llama' is not supported"):
        load_pretrained(path)
    path = write_gguf(hf["llama", "smollm"], tmp_path / "pre.gguf", "F32", style="smollm",
                      meta_overrides={"tokenizer.ggml.pre": "chatglm-bpe"})
    with pytest.raises(PretrainedError, match=r"pre.gguf: metadata tokenizer.ggml.pre='chatglm-bpe' is not supported"):
        load_pretrained(path)


def test_the_parity_reference_splits_text_as_the_gguf_says(files, hf):
    """transformers' GGUF loader splits a 'smollm' vocabulary with GPT-2's regex alone; the parity bench's HFLM gets
    the GGUF's own split, so a space before a digit gives the ids Kiln (and llama.cpp) give."""
    from transformers import AutoTokenizer

    from kiln.evaluation.standard.parity import use_gguf_pretokenizer
    from kiln.tokens.tokenizer import load_encoding

    path = files["F32"]
    text = "Mix  3 eggs,  12 cups\n\n  7 times"
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    before = tok.encode(text, add_special_tokens=False)
    assert "Digits" in use_gguf_pretokenizer(tok, path)
    after = tok.encode(text, add_special_tokens=False)
    reference = AutoTokenizer.from_pretrained(str(hf["llama", "smollm"])).encode(text, add_special_tokens=False)
    record = import_pretrained(path, path.parent / "parity-import")
    kiln_ids = load_encoding(record["tokenizer"]).encode(text, allowed_special=set())
    assert after == reference == kiln_ids
    assert before != after  # the loader's own split differs here: the reason for the override
