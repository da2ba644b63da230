"""kiln.pretrained.tokenizer: Hugging Face byte-level BPE tokenizers as tiktoken encodings with identical ids."""

import json

import pytest
from tokenizers import Tokenizer

from hfmodels import corpus, tiny_tokenizer
from kiln.pretrained.config import PretrainedError
from kiln.pretrained.tokenizer import check_same_ids, encoding_from_hf
from kiln.tokens.tokenizer import GPT2_PAT_STR, load_encoding, save_encoding

STYLES = ("gpt2", "llama3", "qwen2", "smollm")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    out = {}
    for style in STYLES:
        tiny_tokenizer(style).save(str(root / f"{style}.json"))
        out[style] = root / f"{style}.json"
    return out


@pytest.mark.parametrize("style", STYLES)
def test_same_ids_as_tokenizers_on_a_corpus_with_specials(saved, style):
    imported = encoding_from_hf(saved[style])
    texts = corpus(200, seed=7) + [f"one{t}two {t}\n" for t in ("<|endoftext|>", "<|im_start|>", "<|begin_of_text|>")]
    assert check_same_ids(imported, saved[style], texts) >= 200
    hf = Tokenizer.from_file(str(saved[style]))
    enc = imported.encoding
    for t in hf.get_added_tokens_decoder().values():
        assert enc.encode(t.content, allowed_special="all") == [hf.token_to_id(t.content)]
    assert enc.decode(enc.encode(texts[0])) == texts[0]


def test_gpt2_style_uses_gpt2_split_and_keeps_its_endoftext(saved):
    imported = encoding_from_hf(saved["gpt2"])
    hf = Tokenizer.from_file(str(saved["gpt2"]))
    assert imported.encoding._pat_str == GPT2_PAT_STR
    assert imported.encoding.eot_token == hf.token_to_id("<|endoftext|>")
    assert imported.added == {"<|user|>": imported.imported_vocab, "<|assistant|>": imported.imported_vocab + 1}


def test_chat_tokens_are_added_after_every_imported_id(saved):
    imported = encoding_from_hf(saved["llama3"])
    n = Tokenizer.from_file(str(saved["llama3"])).get_vocab_size()
    assert imported.imported_vocab == n
    assert imported.added == {"<|endoftext|>": n, "<|user|>": n + 1, "<|assistant|>": n + 2}
    enc = imported.encoding
    assert enc.encode("<|user|>2+2<|assistant|>4<|endoftext|>", allowed_special="all")[0] == n + 1


def test_imported_encoding_saves_and_loads_as_kiln_encodings_do(saved, tmp_path):
    enc = encoding_from_hf(saved["qwen2"]).encoding
    save_encoding(enc, tmp_path / "tok.json")
    back = load_encoding(tmp_path / "tok.json")
    text = corpus(5)[0]
    assert back.encode(text) == enc.encode(text) and back._special_tokens == enc._special_tokens


def _edit(saved, tmp_path, style, fn):
    doc = json.loads(saved[style].read_text())
    fn(doc)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["model"].update(type="WordPiece"), r"model type 'WordPiece' is not supported"),
    (lambda d: d.update(normalizer={"type": "Lowercase"}), r"normalizer Lowercase is not supported"),
    (lambda d: d.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁"}), r"pre_tokenizer Metaspace is not supported"),
    (lambda d: d["pre_tokenizer"].update(add_prefix_space=True), r"ByteLevel add_prefix_space=true is not supported"),
    (lambda d: d["model"].update(byte_fallback=True), r"BPE byte_fallback=True is not supported"),
    (lambda d: d.update(decoder={"type": "Metaspace"}), r"decoder Metaspace is not byte-level"),
    (lambda d: d["added_tokens"][0].update(lstrip=True), r"added token '<\|endoftext\|>' has lstrip=true"),
    (lambda d: d["model"].update(merges=d["model"]["merges"][::-1]), r"comes after a merge of a higher id"),
])
def test_tokenizers_kiln_cannot_represent_are_refused_by_name(saved, tmp_path, edit, message):
    with pytest.raises(PretrainedError, match=message):
        encoding_from_hf(_edit(saved, tmp_path, "gpt2", edit))


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(PretrainedError, match=r"tokenizer.json: missing; .*save_pretrained"):
        encoding_from_hf(tmp_path / "tokenizer.json")
