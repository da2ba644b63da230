"""Tests for muP (kiln.model.mup, ``model.mup_base_width``): at the base width a muP model is the standard one bit for
bit (init, logits, loss, AdamW steps); at twice the width the hidden init is 1/sqrt(2) of the standard one, the logits
1/2 and the attention scale sqrt(d_base)/d in every attention path; AdamW's hidden lr is 1/m, Muon's unscaled; the
paper's coordinate check (logit change after 3 AdamW steps flat across widths under muP, growing under SP); a muP
model trains through kiln's trainer; release folds the multipliers into transformers' weights (same logits) and
refuses a family that cannot; config errors name the field.

Run: python -m pytest tests/kiln/model/test_mup.py -q   (tiny models on CPU; about 20 s)
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.model import mup
from kiln.model.cache import KVCache
from kiln.model.config import ModelConfig, model_dict, padded_vocab
from kiln.model.families import build_model
from kiln.model.masks import document_mask
from kiln.train.optim import MuonAdamW, OptimConfig, make_optimizer

CPU = torch.device("cpu")
FAMILIES = ("gpt2", "llama")


def config(family: str, width: int, base: int = 0, **kw) -> ModelConfig:
    """A tiny model of ``family``: 2 layers, 4 heads at every width, vocabulary 64."""
    extra = {"family": family, "n_kv_head": 2} if family == "llama" else {}
    return ModelConfig(**{**dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=width, dropout=0.0),
                          **extra, **kw}, mup_base_width=base)


def built(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(cfg)


def tokens(n: int = 2, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (n, t), generator=torch.Generator().manual_seed(seed))


def hidden(model: torch.nn.Module) -> list[str]:
    """The blocks' weight matrices (muP's hidden weights)."""
    return [n for n, p in model.named_parameters() if p.dim() == 2 and (".h." in n or ".layers." in n)]


# -- at the base width: the standard model, bit for bit

@pytest.mark.parametrize("family", FAMILIES)
def test_at_the_base_width_mup_is_the_standard_model_bit_for_bit(family) -> None:
    sp, mu = built(config(family, 64)), built(config(family, 64, base=64))
    assert mup.attention_scale(mu.config) is None and mu.output_scale is None
    for (name, a), b in zip(sp.state_dict().items(), mu.state_dict().values()):
        assert torch.equal(a, b), name
    x, y = tokens(), tokens(seed=2)
    assert torch.equal(sp(x), mu(x)) and torch.equal(sp(x, y), mu(x, y))
    # three AdamW steps: the same lrs (muP's hidden group at lr x 1), the same weights
    opts = [make_optimizer(m, OptimConfig(lr=1e-2, warmup_steps=0), CPU) for m in (sp, mu)]
    assert [g["lr"] for g in opts[1].param_groups] == [1e-2] * 3  # tables, vectors, hidden matrices
    for _ in range(3):
        for m, opt in zip((sp, mu), opts):
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(sp.state_dict().items(), mu.state_dict().values()):
        assert torch.equal(a, b), name


def test_model_dict_leaves_mup_out_at_zero_and_reads_it_back() -> None:
    sp = config("gpt2", 64)
    assert "mup_base_width" not in model_dict(sp)  # plans and checkpoints of standard models hash as before
    assert model_dict(sp) == {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64,
                              "dropout": 0.0, "bias": True}
    mu = config("llama", 128, base=64)
    assert model_dict(mu)["mup_base_width"] == 64 and ModelConfig(**model_dict(mu)) == mu


# -- at twice the width

@pytest.mark.parametrize("family", FAMILIES)
def test_at_twice_the_width_hidden_init_is_over_sqrt2_logits_halved(family) -> None:
    sp, mu = built(config(family, 128)), built(config(family, 128, base=64))
    s, m = sp.state_dict(), mu.state_dict()
    for name in s:
        if name in hidden(sp):  # the same draws, 1/sqrt(2) the std
            assert torch.allclose(m[name], s[name] / math.sqrt(2), rtol=1e-6, atol=1e-9), name
            assert m[name].std() / s[name].std() == pytest.approx(1 / math.sqrt(2), rel=1e-5)
        else:  # tables, (tied) head, norms, biases: unchanged
            assert torch.equal(m[name], s[name]), name
    x = tokens()
    assert mu.output_scale == 0.5
    with torch.no_grad():
        logits = mu(x)
        mu.output_scale = None  # the same weights without muP's output multiplier
        plain = mu(x)
    assert torch.allclose(logits, plain / 2, rtol=1e-6, atol=1e-7) and plain.abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_scale_is_sqrt_base_head_dim_over_head_dim_in_every_path(family, monkeypatch) -> None:
    cfg = config(family, 128, base=64)  # d = 32, d_base = 16: scale 4 / 32, not 1 / sqrt(32)
    assert mup.attention_scale(cfg) == 0.125
    model = built(cfg).eval()
    seen: list = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kw):
        seen.append(kw.get("scale"))
        return sdpa(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    x = tokens(t=12)
    with torch.no_grad():
        full = model(x)  # plain causal
        masked = model(x, attn_mask=document_mask(x, eot=10**6))  # a document mask (one document: the causal mask)
        cache = KVCache.for_model(model, 2)
        # prefill 8, one token, then the rest: (2, 12, V)
        cached = torch.cat([model(x[:, s], cache=cache) for s in (slice(0, 8), slice(8, 9), slice(9, 12))], 1)
    assert seen == [0.125] * (5 * cfg.n_layer)  # 5 forwards (plain, masked, 3 cached), each layer once
    assert torch.allclose(masked, full, atol=1e-5) and torch.allclose(cached, full, atol=1e-5)
    monkeypatch.undo()
    for block in model.blocks:  # had a path used 1/sqrt(d), the logits would differ
        (block.attn if family == "gpt2" else block.self_attn).scale = None
    with torch.no_grad():
        assert (model(x) - full).abs().max() > 1e-4


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"model.mup_base_width \(-64\) must be 0"):
        config("gpt2", 64, base=-64)
    with pytest.raises(ValueError, match=r"model.mup_base_width \(66\) must be divisible by model.n_head \(4\)"):
        config("gpt2", 128, base=66)
    with pytest.raises(ValueError, match="model.mup_base_width applies to the gpt2 and llama families only"):
        ModelConfig(family="moe", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, mup_base_width=32)


# -- the optimizer

@pytest.mark.parametrize("family", FAMILIES)
def test_adamw_hidden_lr_is_over_m_and_muon_lr_is_unscaled(family) -> None:
    model = built(config(family, 256, base=64))  # m = 4
    opt = make_optimizer(model, OptimConfig(lr=4e-3), CPU)
    assert isinstance(opt, torch.optim.AdamW) and [g["lr"] for g in opt.param_groups] == [4e-3, 4e-3, 1e-3]
    ids = {id(p): n for n, p in model.named_parameters()}
    assert [ids[id(p)] for p in opt.param_groups[2]["params"]] == hidden(model)
    assert opt.param_groups[2]["weight_decay"] == opt.param_groups[0]["weight_decay"] == 0.1
    muon = make_optimizer(model, OptimConfig(name="muon", lr=4e-3, muon_lr=0.02), CPU)
    assert isinstance(muon, MuonAdamW)
    assert [(g["kind"], g["lr"]) for g in muon.param_groups] == [("adamw", 4e-3), ("adamw", 4e-3), ("muon", 0.02)]
    assert [ids[id(p)] for p in muon.param_groups[2]["params"]] == hidden(model)
    standard = make_optimizer(built(config(family, 256)), OptimConfig(lr=4e-3), CPU)
    assert [g["lr"] for g in standard.param_groups] == [4e-3, 4e-3]  # unchanged without muP


# -- the paper's coordinate check

def logit_change(family: str, width: int, base: int, steps: int = 3) -> float:
    """RMS of the change of the output logits after ``steps`` AdamW steps at lr 1e-2 on random tokens."""
    model = built(config(family, width, base))
    x, y = tokens(8, 32, seed=3), tokens(8, 32, seed=4)
    opt = make_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0, warmup_steps=0), CPU)
    with torch.no_grad():
        before = model(x)
    for _ in range(steps):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return float((model(x) - before).pow(2).mean().sqrt())


@pytest.mark.parametrize("family", FAMILIES)
def test_coordinate_check_logit_change_is_flat_under_mup_and_grows_under_sp(family, one_thread) -> None:
    widths = (64, 128, 256)
    sp = [logit_change(family, w, 0) for w in widths]
    mu = [logit_change(family, w, 64) for w in widths]
    assert sp[0] == mu[0]  # the base width: the same run
    assert sp[0] < sp[1] < sp[2] and sp[2] / sp[0] > 2.0, sp  # measured 2.3x (gpt2), 2.9x (llama)
    assert max(mu) / min(mu) < 1.5, mu  # measured 1.24, 1.19


# -- through kiln's trainer

def test_a_mup_model_trains_through_the_trainer(tmp_path, pretrain_job, model_dict, one_thread) -> None:
    from kiln.train.checkpoint import load_for_inference
    from kiln.train.loop import main
    from tests.conftest import LineReporter

    model = {**model_dict, "dropout": 0.0, "n_embd": 48, "n_head": 2, "mup_base_width": 24}  # m = 2
    job = pretrain_job(tmp_path, model=model, max_steps=20, eval_interval=20, ckpt_interval=20, log_interval=20)
    res = main(["--config", str(job), "--device", "cpu"], reporter=LineReporter())
    assert res["final_val_loss"] < res["initial_val_loss"] - 0.5, res["history"]
    trained, _, meta = load_for_inference(res["checkpoint"])
    assert meta["model"]["mup_base_width"] == 24 and trained.output_scale == 0.5


# -- release

def _release(tmp_path: Path, tiny_tokenizer, cfg: ModelConfig) -> tuple[Path, torch.nn.Module]:
    from kiln.release.bundle import write_release
    from kiln.train.checkpoint import save_checkpoint

    _, tok_path = tiny_tokenizer
    m = built(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms and biases away from 1 and 0, so a misplaced fold shows
    m.eval()
    save_checkpoint(tmp_path / "run" / "checkpoints", 5, {"model": m.state_dict()},
                    {"model": model_dict(cfg), "task": "pretrain"}, extra_files={"tokenizer.json": tok_path})
    write_release(tmp_path / "run", tmp_path / "release", card="# test\n")
    return tmp_path / "release", m


RELEASED = {  # name -> (family, fields): 4 heads of 8 at the base width 32, twice as wide
    "gpt2": ("gpt2", {}),
    "llama-untied": ("llama", {"tie_embeddings": False}),
    "qwen3-qk-norm": ("llama", {"qk_norm": True}),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_release_folds_the_multipliers_and_transformers_gives_kilns_logits(tmp_path, tiny_tokenizer, name) -> None:
    import transformers

    from kiln.release.bundle import load_release

    enc, _ = tiny_tokenizer
    family, extra = RELEASED[name]
    cfg = config(family, 64, base=32, vocab_size=padded_vocab(enc.n_vocab), **extra)
    bundle, kiln_model = _release(tmp_path, tiny_tokenizer, cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundle).eval()
    idx = torch.randint(0, enc.n_vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = kiln_model(idx), hf(idx).logits
        released, _ = load_release(bundle)  # back into a muP model: the folds taken out again
        back = released(idx)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.allclose(back, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the fold is what makes them agree: without it the logits are twice Kiln's
        kiln_model.output_scale = None
        assert not torch.allclose(got, kiln_model(idx), atol=1e-3)


def test_release_round_trip_is_exact_when_the_folds_are_powers_of_two() -> None:
    from kiln.release.hf import from_hf_state_dict, to_hf_state_dict

    for family in FAMILIES:
        cfg = config(family, 128, base=32)  # m = 4: queries x 1/2, final norm x 1/4
        state = built(cfg).state_dict()
        hf = to_hf_state_dict(state, cfg)
        norm = "transformer.ln_f.weight" if family == "gpt2" else "model.norm.weight"
        assert torch.equal(hf[norm], state[norm] / 4)
        back = from_hf_state_dict(hf, cfg)
        assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state), family


def test_release_refuses_a_family_that_cannot_fold_naming_the_field(monkeypatch) -> None:
    from kiln.model.families import family
    from kiln.release import hf

    cfg = config("llama", 128, base=64)
    monkeypatch.setattr(hf, "of", lambda c: replace(family(c.family), adapter=replace(family(c.family).adapter, mup_fold=None)))
    with pytest.raises(hf.ReleaseError, match=r"model.mup_base_width=64 with n_embd=128: .* release a model trained "
                                              r"with model.mup_base_width equal to model.n_embd .* or 0"):
        hf.to_hf_state_dict(built(cfg).state_dict(), cfg)
    at_base = config("llama", 64, base=64)  # nothing to fold at the base width: released as it is
    assert set(hf.to_hf_state_dict(built(at_base).state_dict(), at_base)) >= {"model.norm.weight"}
