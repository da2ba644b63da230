"""kiln.release.gguf: a Kiln llama written as GGUF loads in transformers' GGUF loader with Kiln's logits (F32 within
1e-4; F16 within 1e-4 of Kiln with its weights rounded to F16, as the file holds them; Q8_0 within a stated bound of
the unrounded model) and tokenizes as Kiln does; Kiln's own import reads it back."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from kiln.model.config import ModelConfig, model_dict, padded_vocab
from kiln.model.families import build_model
from kiln.pretrained.source import load_pretrained
from kiln.release.gguf import write_gguf
from kiln.release.hf import CHAT_TEMPLATE, PROBE_TEXTS, ReleaseError

Q8_BOUND = 0.05  # max |logit difference| of Q8_0 against the unrounded tiny model (measured 0.004-0.006 here)


def tiny_llama(enc, **kw) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = ModelConfig(family="llama", vocab_size=padded_vocab(enc.n_vocab), block_size=64, n_layer=2, n_head=4,
                      n_kv_head=2, n_embd=64, rope_theta=10000.0, **kw)
    torch.manual_seed(0)
    m = build_model(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from 1: a misread weight shows in the logits
    return cfg, m.eval()


def hf_from_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def written(tiny_tokenizer, tmp_path_factory):
    enc, _ = tiny_tokenizer
    cfg, m = tiny_llama(enc)
    root = tmp_path_factory.mktemp("gguf-out")
    files = {q: write_gguf(m.state_dict(), cfg, enc, root / f"m-{q}.gguf", q, chat_template=CHAT_TEMPLATE,
                           name="tiny", license="apache-2.0") for q in ("F32", "F16", "Q8_0")}
    return cfg, m, root, files


def ids_of(enc, n=2, t=32):
    return torch.randint(0, enc.n_vocab, (n, t), generator=torch.Generator().manual_seed(4))


def test_f32_logits_equal_kilns(written, tiny_tokenizer):
    cfg, m, root, files = written
    ids = ids_of(tiny_tokenizer[0])
    with torch.no_grad():
        diff = (hf_from_gguf(root / "m-F32.gguf")(ids).logits - m(ids)).abs().max().item()
    assert diff <= 1e-4
    assert files["F32"]["tensor_types"] == {"F32": 20} and files["F32"]["pre"] == "llama-bpe"  # tied: no output.weight


def test_f16_logits_equal_kilns_with_f16_weights(written, tiny_tokenizer):
    cfg, m, root, files = written
    rounded = build_model(cfg).eval()
    rounded.load_state_dict({k: (v.half().float() if v.dim() == 2 else v) for k, v in m.state_dict().items()})
    ids = ids_of(tiny_tokenizer[0])
    with torch.no_grad():
        hf = hf_from_gguf(root / "m-F16.gguf")(ids).logits
        assert (hf - rounded(ids)).abs().max().item() <= 1e-4
        assert 0 < (hf - m(ids)).abs().max().item() < 1e-2  # the rounding, and no more
    assert files["F16"]["tensor_types"] == {"F16": 15, "F32": 5}


def test_q8_0_within_its_bound_and_kiln_reads_what_transformers_reads(written, tiny_tokenizer):
    cfg, m, root, files = written
    ids = ids_of(tiny_tokenizer[0])
    state, cfg2, tok, record = load_pretrained(root / "m-Q8_0.gguf")
    back = build_model(cfg2).eval()
    back.load_state_dict(state)
    with torch.no_grad():
        hf = hf_from_gguf(root / "m-Q8_0.gguf")(ids).logits
        n = tiny_tokenizer[0].n_vocab
        assert (hf[..., :n] - back(ids)[..., :n]).abs().max().item() <= 1e-4
        assert (hf - m(ids)).abs().max().item() <= Q8_BOUND
    assert files["Q8_0"]["tensor_types"]["Q8_0"] >= 14 and files["Q8_0"]["bytes"] < files["F16"]["bytes"]


def test_the_file_carries_the_tokenizer_template_and_licence(written, tiny_tokenizer):
    from transformers import AutoTokenizer

    enc, _ = tiny_tokenizer
    cfg, m, root, files = written
    r = GGUFReader(str(root / "m-F16.gguf"))
    assert r.fields["tokenizer.chat_template"].contents() == CHAT_TEMPLATE
    assert r.fields["general.license"].contents() == "apache-2.0"
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == enc.eot_token
    hf_tok = AutoTokenizer.from_pretrained(str(root), gguf_file="m-F16.gguf")
    for text in [*PROBE_TEXTS[:5], "the cat sat on 12345 mats\n\n  and more"]:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == enc.encode(text), text


def test_kiln_reimports_its_own_file_exactly(written, tiny_tokenizer):
    enc, _ = tiny_tokenizer
    cfg, m, root, files = written
    state, cfg2, tok, record = load_pretrained(root / "m-F32.gguf")
    same = {k: v for k, v in model_dict(cfg).items() if k != "norm_eps"}
    assert {k: v for k, v in model_dict(cfg2).items() if k != "norm_eps"} == same
    assert cfg2.norm_eps == pytest.approx(cfg.norm_eps, rel=1e-6)  # stored as float32
    assert tok.added == {} and tok.encoding.n_vocab == enc.n_vocab
    for k, v in m.state_dict().items():
        torch.testing.assert_close(state[k], v, atol=0, rtol=0)
    for text in PROBE_TEXTS:
        assert tok.encoding.encode(text, allowed_special="all") == enc.encode(text, allowed_special="all")


def test_qwen3_and_digit_split_round_trip(tiny_tokenizer, tmp_path):
    from kiln.tokens.tokenizer import DIGITS_PAT_STR, train_bpe

    enc = train_bpe(["numbers 12345 and 678 in text " * 5, "more text with 90210 and words"] * 20, 300, DIGITS_PAT_STR)
    cfg, m = tiny_llama(enc, qk_norm=True)
    out = write_gguf(m.state_dict(), cfg, enc, tmp_path / "q.gguf", "F32")
    assert out["pre"] == "qwen2"
    state, cfg2, tok, _ = load_pretrained(tmp_path / "q.gguf")
    assert cfg2.qk_norm and tok.encoding.encode("a 12345 b") == enc.encode("a 12345 b")
    for k, v in m.state_dict().items():
        torch.testing.assert_close(state[k], v, atol=0, rtol=0)


def test_unsupported_family_and_type_refused(tiny_tokenizer, tmp_path):
    enc, _ = tiny_tokenizer
    cfg = ModelConfig(family="gpt2", vocab_size=padded_vocab(enc.n_vocab), block_size=32, n_layer=1, n_head=2, n_embd=32)
    with pytest.raises(ReleaseError, match=r"model.family='gpt2': Kiln writes GGUF for the llama family"):
        write_gguf(build_model(cfg).state_dict(), cfg, enc, tmp_path / "g.gguf")
    cfg, m = tiny_llama(enc)
    with pytest.raises(ReleaseError, match=r"GGUF type 'Q4_K'"):
        write_gguf(m.state_dict(), cfg, enc, tmp_path / "g.gguf", "Q4_K")
    assert not (tmp_path / "g.gguf").exists()


def test_release_bundle_holds_ggufs_listed_on_its_card(tiny_tokenizer, tmp_path):
    from kiln.model.config import model_dict as md
    from kiln.release.bundle import verify_release, write_release
    from kiln.train.checkpoint import save_checkpoint

    enc, tok_path = tiny_tokenizer
    cfg, m = tiny_llama(enc)
    save_checkpoint(tmp_path / "run" / "checkpoints", 3, {"model": m.state_dict()}, {"model": md(cfg), "task": "sft"},
                    extra_files={"tokenizer.json": tok_path})
    manifest = write_release(tmp_path / "run", tmp_path / "b", "# card\n", gguf_types=("F16", "Q8_0"), name="t",
                             license="apache-2.0")
    verify_release(tmp_path / "b")
    card = (tmp_path / "b" / "README.md").read_text()
    for g in manifest["gguf"]["files"]:
        assert manifest["files"][g["file"]] == g["sha256"] and f"`{g['sha256']}`" in card
    assert "| model-Q8_0.gguf | GGUF Q8_0 (F32 5, Q8_0 15) |" in card and card.startswith("# card\n")
    assert f"`{manifest['files']['model.safetensors']}`" in card
    r = GGUFReader(str(tmp_path / "b" / "model-F16.gguf"))
    assert r.fields["tokenizer.chat_template"].contents() == CHAT_TEMPLATE and r.fields["general.name"].contents() == "t"
    gpt = ModelConfig(family="gpt2", vocab_size=padded_vocab(enc.n_vocab), block_size=32, n_layer=1, n_head=2, n_embd=32)
    save_checkpoint(tmp_path / "g" / "checkpoints", 1, {"model": build_model(gpt).state_dict()},
                    {"model": md(gpt), "task": "sft"}, extra_files={"tokenizer.json": tok_path})
    manifest = write_release(tmp_path / "g", tmp_path / "gb", "# card\n", gguf_types=("F16",))
    assert manifest["gguf"]["files"] == [] and "llama family" in manifest["gguf"]["skipped"]
    assert "No GGUF file: model.family='gpt2'" in (tmp_path / "gb" / "README.md").read_text()
    assert not list((tmp_path / "gb").glob("*.gguf"))
