"""Tests of kiln/release/hf.py: the llama family's release (transformers loads the bundle as LlamaForCausalLM, or
Qwen3ForCausalLM with QK-norm, with no Kiln code and gives Kiln's logits; the bundle reloads into Kiln; a tied head is not
written twice), and special tokens away from Kiln's own layout: an imported SmolLM-style tokenizer (specials at ids
0..k-1, before the byte-level vocabulary) releases with identical ids; genuine collisions are refused by name.

Run: python -m pytest tests/kiln/release/test_hf.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiktoken
import torch
from safetensors.torch import load_file

from hfmodels import corpus, save_tiny
from kiln.model.config import ModelConfig, model_dict, padded_vocab
from kiln.model.families import build_model
from kiln.release.bundle import load_release, verify_release, write_release
from kiln.release.hf import (ReleaseError, bytes_to_unicode, from_hf_state_dict, hf_config, hf_tokenizer, special_layout,
                             to_hf_state_dict)
from kiln.train.checkpoint import load_for_inference, save_checkpoint

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


SHAPES = {
    "llama-gqa-tied": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, rope_theta=500000.0),
    "llama-untied": dict(n_layer=2, n_head=4, n_kv_head=1, n_embd=32, intermediate_size=96, tie_embeddings=False),
    "qwen3-qk-norm": dict(n_layer=1, n_head=2, n_embd=32, qk_norm=True, norm_eps=1e-6),
}


def _release(tmp_path: Path, tiny_tokenizer, cfg: ModelConfig) -> tuple[Path, torch.nn.Module]:
    enc, tok_path = tiny_tokenizer
    torch.manual_seed(0)
    m = build_model(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from 1, so a misread weight shows in the logits
    m.eval()
    save_checkpoint(tmp_path / "run" / "checkpoints", 5, {"model": m.state_dict()}, {"model": model_dict(cfg), "task": "pretrain"},
                    extra_files={"tokenizer.json": tok_path})
    write_release(tmp_path / "run", tmp_path / "release", card="# test\n")
    return tmp_path / "release", m


@pytest.mark.parametrize("name", list(SHAPES))
def test_transformers_loads_the_llama_bundle_with_kilns_logits(tmp_path, tiny_tokenizer, name) -> None:
    import transformers

    enc, _ = tiny_tokenizer
    cfg = ModelConfig(family="llama", vocab_size=padded_vocab(enc.n_vocab), block_size=32, **SHAPES[name])
    bundle, kiln_model = _release(tmp_path, tiny_tokenizer, cfg)
    verify_release(bundle)
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundle).eval()
    want_class = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    assert type(hf).__name__ == want_class
    assert (hf.config.num_key_value_heads, hf.config.intermediate_size) == (cfg.n_kv_head, cfg.intermediate_size)
    idx = torch.randint(0, enc.n_vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = kiln_model(idx), hf(idx).logits  # (B, T, vocab)
    assert got.shape == want.shape == (2, 32, cfg.vocab_size)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    tied = hf.get_output_embeddings().weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    assert tied == cfg.tie_embeddings
    written = load_file(str(bundle / "model.safetensors"))
    assert ("lm_head.weight" in written) == (not cfg.tie_embeddings)  # an untied head is its own matrix
    assert set(written) | {"lm_head.weight"} == set(kiln_model.state_dict()) | {"lm_head.weight"}

    released, _ = load_release(bundle)  # and back into Kiln, both ways
    loaded, _, meta = load_for_inference(tmp_path / "run")
    assert meta["model"] == model_dict(cfg)
    with torch.no_grad():
        assert torch.equal(released(idx), want) and torch.equal(loaded(idx), want)


def test_llama_state_dict_round_trip_and_config_fields() -> None:
    cfg = ModelConfig(family="llama", vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=16)
    state = build_model(cfg).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(state, cfg), cfg)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    conf = hf_config(cfg, eot=7)
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["tie_word_embeddings"] is True
    assert (conf["head_dim"], conf["num_key_value_heads"], conf["intermediate_size"]) == (8, 2, 64)
    assert conf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
