"""kiln.release.hf with special tokens away from Kiln's own layout: an imported SmolLM-style tokenizer (specials at ids
0..k-1, before the byte-level vocabulary) releases with identical ids; genuine collisions are refused by name.

Run: python -m pytest tests/kiln/release/test_hf_specials.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiktoken

from hfmodels import corpus, save_tiny
from kiln.release.hf import ReleaseError, bytes_to_unicode, hf_tokenizer, special_layout

SMOL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"]


def specials_first_tokenizer(vocab_size: int = 400):
    """A SmolLM-style byte-level BPE (Digits + ByteLevel) whose trainer puts the specials at ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SMOL_SPECIALS, show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    assert [tok.token_to_id(t) for t in SMOL_SPECIALS] == [0, 1, 2, 3]
    return tok


@pytest.fixture(scope="module")
def smol_release(tmp_path_factory):
    """(source folder, imported encoding, release folder): a tiny llama with the tokenizer above, imported by
    kiln.pretrained and released by kiln.release."""
    from kiln.pretrained.source import import_pretrained
    from kiln.release.bundle import write_release
    from kiln.tokens.tokenizer import load_encoding

    root = tmp_path_factory.mktemp("smol")
    folder = save_tiny(root / "smol", "llama", "smollm")
    specials_first_tokenizer().save(str(folder / "tokenizer.json"))  # 400 tokens: fits the 408-row embedding
    record = import_pretrained(folder, root / "imported", corpus(40, seed=4))
    write_release(record["checkpoint"], root / "release", card="# smol\n")
    return folder, load_encoding(Path(record["tokenizer"])), root / "release"


def chat_texts() -> list[str]:
    return ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
            "<repo_name>kiln\n<|endoftext|>def f(x): return 12345<|endoftext|>", "<|user|>hi<|assistant|>ok<|endoftext|>",
            " <|im_start|> <|endoftext|>\n\n<|assistant|>  x", "<|endoftext|>"]


def test_released_smollm_tokenizer_gives_kilns_ids_with_transformers(smol_release):
    import transformers
    from tokenizers import Tokenizer

    folder, enc, release = smol_release
    assert [enc._special_tokens[t] for t in SMOL_SPECIALS] == [0, 1, 2, 3]
    assert (enc._special_tokens["<|user|>"], enc._special_tokens["<|assistant|>"], enc.eot_token) == (400, 401, 0)
    tok = transformers.AutoTokenizer.from_pretrained(release)
    texts = corpus(150, seed=11) + chat_texts()
    for t in texts:
        ids = enc.encode(t, allowed_special="all")
        assert tok(t)["input_ids"] == ids, t
        assert tok.decode(ids) == enc.decode(ids), t
    source = Tokenizer.from_file(str(folder / "tokenizer.json"))  # and the source model's own ids, where it knows them
    for t in texts:
        if "<|user|>" not in t and "<|assistant|>" not in t:
            assert tok(t)["input_ids"] == source.encode(t, add_special_tokens=False).ids, t
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|endoftext|>", 0, 0)
    assert set(tok.all_special_tokens) == {*SMOL_SPECIALS, "<|user|>", "<|assistant|>"}
    assert [tok.convert_tokens_to_ids(t) for t in SMOL_SPECIALS] == [0, 1, 2, 3]
    doc = json.loads((release / "tokenizer.json").read_text())
    assert [doc["model"]["vocab"][t] for t in SMOL_SPECIALS] == [0, 1, 2, 3]  # in the vocabulary, as SmolLM ships
    assert "<|user|>" not in doc["model"]["vocab"]  # Kiln's chat tokens added after it
    assert json.loads((release / "config.json").read_text())["eos_token_id"] == 0


def test_released_smollm_model_loads_in_transformers(smol_release):
    import torch
    import transformers

    _, enc, release = smol_release
    hf = transformers.AutoModelForCausalLM.from_pretrained(release).eval()
    ids = torch.tensor([enc.encode(chat_texts()[0], allowed_special="all")])
    with torch.no_grad():
        assert hf(ids).logits.shape == (1, ids.shape[1], hf.config.vocab_size)


def test_special_layout_keeps_kilns_own_layout_after_the_vocabulary(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    b2u = bytes_to_unicode()
    vocab = {"".join(b2u[b] for b in t): r for t, r in enc._mergeable_ranks.items()}
    inner, after = special_layout(enc, vocab)
    assert inner == [] and after == sorted(enc._special_tokens.items(), key=lambda kv: kv[1])


def _with_specials(enc, specials: dict[str, int]) -> tiktoken.Encoding:
    return tiktoken.Encoding(name="x", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                             special_tokens=specials)


def test_special_on_a_mergeable_id_is_refused_by_name(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    with pytest.raises(ReleaseError, match=r"special token '<\|x\|>' has id 100, which is also the mergeable token"):
        hf_tokenizer(_with_specials(enc, {"<|endoftext|>": enc.n_vocab, "<|x|>": 100}))


def test_special_spelled_like_a_vocabulary_token_is_refused_by_name(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    b2u = bytes_to_unicode()
    token = next(t for t, r in enc._mergeable_ranks.items() if r == 280)
    text = "".join(b2u[b] for b in token)
    with pytest.raises(ReleaseError, match=rf"special token {text!r} \(id {enc.n_vocab}\) is spelled like the "
                                           r"vocabulary token of id 280"):
        hf_tokenizer(_with_specials(enc, {text: enc.n_vocab, "<|endoftext|>": enc.n_vocab + 1}))


def test_special_that_ordinary_text_spells_is_refused_by_name(tiny_tokenizer):
    enc, _ = tiny_tokenizer  # "Ġzyxw" is how byte-level BPE writes the piece " zyxw"
    specials = {"<|endoftext|>": enc.n_vocab, "Ġzyxw": enc.n_vocab + 3}
    with pytest.raises(ReleaseError, match=r"special token 'Ġzyxw' \(id \d+\) is the byte-level spelling of the text ' zyxw'"):
        hf_tokenizer(_with_specials(enc, specials))


def test_specials_sharing_an_id_are_refused_by_name(tiny_tokenizer):
    enc, _ = tiny_tokenizer
    with pytest.raises(ReleaseError, match=r"special tokens '<\|endoftext\|>' and '<\|a\|>' share id \d+"):
        hf_tokenizer(_with_specials(enc, {"<|endoftext|>": enc.n_vocab, "<|a|>": enc.n_vocab}))
