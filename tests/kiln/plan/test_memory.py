"""Tests for kiln.plan: parameter counts, the memory model (checked against a real run), the choice of DDP, FSDP2
and activation checkpointing, batch splitting, and errors that say what would fit.

Run: python -m pytest tests/kiln/plan/test_memory.py -q   (the measured-memory test starts one small training process)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kiln.model.config import MODEL_PRESETS, ModelConfig, preset_fields
from kiln.model.families import build_model, flops_per_token
from kiln.plan.memory import (
    GIB,
    BatchConfig,
    HardwareConfig,
    ParallelConfig,
    PlanError,
    count_params,
    gpu_peak_tflops,
    make_plan,
    measure_matmul_peak,
    memory_breakdown,
    native_cpu_bf16,
    plan_version,
)

GPT2_124M = ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
TINY = ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32)
H100 = dict(device="cuda", memory_gb=80, peak_tflops=989.4)


def gpt2(preset: str) -> ModelConfig:
    return ModelConfig(vocab_size=50304, **preset_fields(preset))


def test_gpt2_small_has_124m_parameters() -> None:
    total, non_embedding = count_params(GPT2_124M)
    assert total == 124_439_808  # the published GPT-2 small count with tied embeddings
    assert non_embedding == 85_056_000
    assert total - non_embedding == (50257 + 1024) * 768


@pytest.mark.parametrize("preset,millions", [("gpt2", 124), ("gpt2-medium", 355), ("gpt2-large", 774), ("gpt2-xl", 1558)])
def test_gpt2_family_presets_have_the_published_sizes(preset, millions) -> None:
    cfg = ModelConfig(vocab_size=50257, **preset_fields(preset))
    assert round(count_params(cfg)[0] / 1e6) == millions
    assert set(MODEL_PRESETS["gpt2"]) >= {"tiny", "demo", "gpt2", "gpt2-medium", "gpt2-large"}
    with pytest.raises(ValueError, match="unknown model preset 'gpt3'.*gpt2-medium"):
        preset_fields("gpt3")


def test_count_params_without_bias_keeps_layernorm_weights() -> None:
    cfg = ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False)
    # per layer 12 C^2 + 2 LayerNorm weights; ln_f weight; embeddings
    assert count_params(cfg)[0] == 2 * (12 * 32**2 + 2 * 32) + 32 + (320 + 32) * 32


LLAMAS = [
    ModelConfig(family="llama", vocab_size=320, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32),
    ModelConfig(family="llama", vocab_size=320, block_size=32, n_layer=3, n_head=4, n_embd=64, intermediate_size=96,
                tie_embeddings=False),
    ModelConfig(family="llama", vocab_size=384, block_size=16, n_layer=1, n_head=6, n_kv_head=1, n_embd=48, qk_norm=True),
    ModelConfig(family="llama", vocab_size=320, block_size=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=32, qk_norm=True,
                tie_embeddings=False),
]


@pytest.mark.parametrize("cfg", [TINY, ModelConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=32, bias=False),
                                 *LLAMAS], ids=lambda c: f"{c.family}-{c.n_layer}x{c.n_embd}")
def test_count_params_matches_the_built_model(cfg) -> None:
    model = build_model(cfg)
    total, body = count_params(cfg)
    assert total == sum(p.numel() for p in model.parameters())  # tied weights counted once
    tables = {"transformer.wte.weight", "transformer.wpe.weight", "model.embed_tokens.weight", "lm_head.weight"}
    assert body == sum(p.numel() for n, p in model.named_parameters() if n not in tables)


def test_llama_count_and_flops_by_hand() -> None:
    cfg = ModelConfig(family="llama", vocab_size=49152, block_size=2048, **{k: v for k, v in
                      preset_fields("smollm-135m", "llama").items() if k not in ("family", "block_size")})
    assert count_params(cfg)[0] == 134_515_008  # SmolLM-135M's published count (tied embeddings)
    c, kv, i = 576, 3 * 64, 1536
    per_layer = 2 * c * c + 2 * c * kv + 3 * c * i  # q, o; GQA's k, v; SwiGLU's three matrices
    assert flops_per_token(cfg, 2048) == 6 * (30 * per_layer + 49152 * c) + 12 * 30 * c * 2048
    untied = ModelConfig(**{**cfg.__dict__, "tie_embeddings": False})
    assert count_params(untied)[0] - count_params(cfg)[0] == 49152 * c  # the untied head is its own matrix
    assert count_params(untied)[1] == count_params(cfg)[1]


def test_llama_activation_memory_follows_gqa_and_swiglu() -> None:
    """Per token per block: 9 C + 2 kv + 4 I elements (4 B each on CPU); GQA's narrower k, v save memory."""
    mha = ModelConfig(family="llama", vocab_size=320, block_size=64, n_layer=4, n_head=4, n_embd=64, intermediate_size=128)
    gqa = ModelConfig(**{**mha.__dict__, "n_kv_head": 1})
    tokens, L = 8 * 64, 4

    def act(cfg, ac=False):
        return memory_breakdown(cfg, 8, 64, False, activation_checkpointing=ac)["activations"] * GIB

    assert act(mha) == tokens * L * 4 * (9 * 64 + 2 * 64 + 4 * 128) + tokens * 3 * 4 * 64
    assert act(mha) - act(gqa) == tokens * L * 4 * 2 * (64 - 16)
    assert act(mha, ac=True) == tokens * (L * 4 * 64 + 4 * (9 * 64 + 2 * 64 + 4 * 128)) + tokens * 3 * 4 * 64
    fsdp = memory_breakdown(gqa, 8, 64, True, world=4, fsdp=True)
    assert fsdp["weights_grads_optimizer"] * GIB == count_params(gqa)[0] * 16 / 4


def test_plan_records_the_family_fields_only() -> None:
    plan = make_plan(LLAMAS[0], BatchConfig(seq_len=32, global_batch=4, max_steps=2), HardwareConfig(memory_gb=16))
    assert plan.model["family"] == "llama" and plan.model["n_kv_head"] == 2 and "bias" not in plan.model
    assert plan.params == count_params(LLAMAS[0])[0]
    assert "family" not in make_plan(TINY, BatchConfig(seq_len=32, global_batch=4, max_steps=2),
                                     HardwareConfig(memory_gb=16)).model  # GPT-2 plans read as before families


def test_state_bytes_per_parameter_replicated_and_sharded() -> None:
    n = count_params(GPT2_124M)[0]
    fp32 = memory_breakdown(GPT2_124M, 2, 32, mixed_precision=False)
    bf16 = memory_breakdown(GPT2_124M, 2, 32, mixed_precision=True)
    assert fp32["weights_grads_optimizer"] * GIB == pytest.approx(16 * n)  # fp32 weights, grads, 2 AdamW moments
    assert bf16["weights_grads_optimizer"] * GIB == pytest.approx(18 * n)  # + autocast's bf16 weight copies
    sharded = memory_breakdown(GPT2_124M, 2, 32, mixed_precision=True, world=8, fsdp=True)
    assert sharded["weights_grads_optimizer"] * GIB == pytest.approx(16 * n / 8)
    c, v = 768, 50257
    in_flight = ((v + 1024 + 2) * c + 2 * (12 * c * c + 13 * c)) * (2 + 4)  # root + 2 blocks, bf16 params + fp32 grads
    assert sharded["params_in_flight"] * GIB == pytest.approx(in_flight)
    for mem in (fp32, bf16, sharded):
        assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))


def test_activation_and_logit_terms() -> None:
    s, b, c, layers = 32, 4, 32, 2
    tokens = s * b
    fp32 = memory_breakdown(TINY, b, s, mixed_precision=False)
    assert fp32["activations"] * GIB == pytest.approx(tokens * (layers * 68 * c + 3 * 4 * c))
    assert fp32["logits"] * GIB == pytest.approx(tokens * 320 * 8 + 320 * c * 4 + tokens * c * 4)  # one chunk here
    big = memory_breakdown(GPT2_124M, 16, 1024, mixed_precision=True)  # 16k tokens: the logits are never whole
    chunk = (256 << 20) // (4 * 50257)
    assert big["logits"] * GIB == pytest.approx(chunk * 50257 * 6 + 50257 * 768 * 4 + 16 * 1024 * 768 * 4)
    assert big["logits"] < 1  # GiB, where (B*T, V) fp32 logits, their log-softmax and gradient would take 9
    bf16 = memory_breakdown(TINY, b, s, mixed_precision=True)
    assert bf16["activations"] * GIB == pytest.approx(tokens * (layers * 38 * c + 3 * 4 * c))
    # recomputation keeps each block's fp32 input plus one block's full set
    ac = memory_breakdown(TINY, b, s, mixed_precision=False, activation_checkpointing=True)
    assert ac["activations"] * GIB == pytest.approx(tokens * (layers * 4 * c + 68 * c + 3 * 4 * c))
    # activations grow linearly in micro-batch
    assert memory_breakdown(TINY, 2 * b, s, False)["activations"] == pytest.approx(2 * fp32["activations"])
    dropout = ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    extra = memory_breakdown(dropout, b, s, False)["activations"] - fp32["activations"]
    assert extra * GIB == pytest.approx(tokens * layers * (2 * c + 13 * 2 * s))  # masks + unfused scores on CPU


@pytest.mark.parametrize("nproc,nnodes,global_batch,micro", [(1, 1, 32, 8), (2, 1, 32, 4), (2, 2, 64, 2), (4, 1, 8, 2)])
def test_micro_batch_times_accumulation_is_the_per_rank_batch(nproc, nnodes, global_batch, micro) -> None:
    plan = make_plan(TINY, BatchConfig(seq_len=32, global_batch=global_batch, micro_batch=micro, max_steps=10),
                     HardwareConfig(nproc_per_node=nproc, nnodes=nnodes, memory_gb=16, peak_tflops=1.0))
    world = nproc * nnodes
    assert plan.world_size == world
    assert plan.micro_batch == micro
    assert plan.micro_batch * plan.grad_accum == global_batch // world
    assert plan.micro_batch * plan.grad_accum * plan.world_size == plan.global_batch == global_batch
    assert plan.parallelism == ("none" if world == 1 else "ddp")
    assert not plan.activation_checkpointing
    assert plan.tokens_per_step == global_batch * 32
    assert plan.total_tokens == global_batch * 32 * 10


def test_plan_totals_and_estimates() -> None:
    batch = BatchConfig(seq_len=32, global_batch=8, micro_batch=8, max_steps=100)
    plan = make_plan(TINY, batch, HardwareConfig(memory_gb=8, peak_tflops=2.0))
    fpt = flops_per_token(TINY, 32)
    assert plan.params == count_params(TINY)[0]
    assert plan.flops_per_token == fpt
    assert plan.total_flops == fpt * 8 * 32 * 100
    assert plan.est_hours == pytest.approx(fpt * 25600 / (2.0e12 * 0.4) / 3600)
    assert plan.tokens_per_param == pytest.approx(25600 / plan.params)
    assert plan.device_memory_gb == 8 and plan.peak_tflops == 2.0
    assert plan.to_dict()["model"]["n_embd"] == 32


def test_planner_picks_the_largest_micro_batch_that_fits_and_divides() -> None:
    per_rank = 12
    totals = {m: memory_breakdown(TINY, m, 32, False)["total"] for m in range(1, per_rank + 1)}
    memory_gb = totals[5] / 0.8 * 1.0001  # budget (80%) holds micro 5 but not 6
    no_ac = ParallelConfig(activation_checkpointing=False)
    plan = make_plan(TINY, BatchConfig(seq_len=32, global_batch=per_rank), HardwareConfig(memory_gb=memory_gb), no_ac)
    assert plan.micro_batch == 4  # 5 fits but does not divide 12
    assert plan.grad_accum == 3
    assert plan.memory_gb["total"] == pytest.approx(totals[4], abs=1e-4)
    # left to choose, the planner recomputes activations to fit the whole per-rank batch in one pass
    auto = make_plan(TINY, BatchConfig(seq_len=32, global_batch=per_rank), HardwareConfig(memory_gb=memory_gb))
    assert auto.activation_checkpointing and auto.micro_batch > 4 and "needed to fit" in auto.reason
    # with plenty of memory the whole per-rank batch goes in one pass, without recomputation
    big = make_plan(TINY, BatchConfig(seq_len=32, global_batch=per_rank), HardwareConfig(memory_gb=64))
    assert (big.micro_batch, big.grad_accum, big.activation_checkpointing) == (12, 1, False)


def test_gpt2_124m_presets_on_one_and_eight_h100s() -> None:
    batch = BatchConfig(seq_len=1024, global_batch=512, max_steps=19073)
    one = make_plan(gpt2("gpt2"), batch, HardwareConfig(nproc_per_node=1, **H100))
    assert (one.parallelism, one.activation_checkpointing, one.micro_batch, one.grad_accum) == ("none", False, 128, 4)
    assert 30 < one.memory_gb["total"] < 0.8 * 80 and one.memory_gb["logits"] < 1
    assert one.tokens_per_param == pytest.approx(512 * 1024 * 19073 / one.params)
    eight = make_plan(gpt2("gpt2"), batch, HardwareConfig(nproc_per_node=8, **H100))
    assert (eight.parallelism, eight.activation_checkpointing, eight.micro_batch, eight.grad_accum) == ("ddp", False, 64, 1)
    assert eight.est_hours == pytest.approx(one.est_hours / 8)


def test_fsdp_and_recomputation_when_replicas_do_not_fit() -> None:
    batch = BatchConfig(seq_len=1024, global_batch=64)
    # 774M parameters x 18 B is 13.9 GB: more than 80% of a 16 GB GPU, so DDP cannot hold even one sequence
    plan = make_plan(gpt2("gpt2-large"), batch, HardwareConfig(device="cuda", nproc_per_node=8, memory_gb=16))
    assert plan.parallelism == "fsdp" and plan.activation_checkpointing and plan.micro_batch == 8
    ddp = [a for a in plan.alternatives if a["parallelism"] == "ddp"]
    assert ddp and all(a["micro_batch"] == 0 for a in ddp)
    assert plan.memory_gb["total"] <= 0.8 * 16 and "params_in_flight" in plan.memory_gb
    # on 80 GB GPUs the same model replicates
    roomy = make_plan(gpt2("gpt2-large"), batch, HardwareConfig(device="cuda", nproc_per_node=8, memory_gb=80))
    assert roomy.parallelism == "ddp" and not roomy.activation_checkpointing
    # a forced strategy is honoured, and one rank never wraps the model
    forced = make_plan(TINY, BatchConfig(seq_len=32, global_batch=8), HardwareConfig(nproc_per_node=2, memory_gb=8),
                       ParallelConfig(strategy="fsdp", compile=True))
    assert forced.parallelism == "fsdp" and forced.compile
    solo = make_plan(TINY, BatchConfig(seq_len=32, global_batch=8), HardwareConfig(memory_gb=8), ParallelConfig(strategy="fsdp"))
    assert solo.parallelism == "none"
    with pytest.raises(PlanError, match="strategy must be auto, ddp or fsdp, not 'zero3'"):
        make_plan(TINY, BatchConfig(seq_len=32, global_batch=8), HardwareConfig(nproc_per_node=2, memory_gb=8),
                  ParallelConfig(strategy="zero3"))


def test_global_batch_not_divisible_by_world_names_it() -> None:
    with pytest.raises(PlanError, match=r"batch\.global_batch=30 is not divisible by 4 ranks; use a multiple of 4"):
        make_plan(TINY, BatchConfig(seq_len=32, global_batch=30), HardwareConfig(nproc_per_node=2, nnodes=2, memory_gb=8))


def test_micro_batch_must_divide_per_rank_batch() -> None:
    with pytest.raises(PlanError, match=r"batch\.micro_batch=3 must divide the per-rank batch 8"):
        make_plan(TINY, BatchConfig(seq_len=32, global_batch=16, micro_batch=3), HardwareConfig(nproc_per_node=2, memory_gb=8))


def test_seq_len_longer_than_block_size_is_rejected() -> None:
    with pytest.raises(PlanError, match=r"batch\.seq_len=64 exceeds model\.block_size=32"):
        make_plan(TINY, BatchConfig(seq_len=64, global_batch=8), HardwareConfig(memory_gb=8))


def test_plan_that_cannot_fit_says_what_would() -> None:
    with pytest.raises(PlanError) as err:
        make_plan(GPT2_124M, BatchConfig(seq_len=1024, global_batch=8), HardwareConfig(memory_gb=0.001))
    msg = str(err.value)
    assert "micro_batch=1" in msg  # the planner already shrank the micro-batch to one sequence
    assert "a device has 0.001 GiB" in msg  # small memory is not rounded to a misleading 0.0
    # nothing fits, even sharded: the message names the largest model that would, 0.8 * 0.001 GiB / 16 B
    assert re.search(r"at most 0\.0537M parameters per device \(this model has 124M\)", msg), msg


def test_plan_that_fits_only_shorter_sequences_names_the_longest() -> None:
    memory = HardwareConfig(memory_gb=2.72)  # 2.18 GiB usable: 2 GiB of state, a little for activations
    with pytest.raises(PlanError) as err:
        make_plan(GPT2_124M, BatchConfig(seq_len=1024, global_batch=8), memory)
    seq = int(re.search(r"fits at micro_batch=1 with seq_len<=(\d+)", str(err.value)).group(1))
    assert 1 < seq < 1024
    # and the suggestion is right: it plans at that length and fails one token later
    batch = BatchConfig(seq_len=seq, global_batch=8)
    assert make_plan(GPT2_124M, batch, memory).micro_batch == 1
    with pytest.raises(PlanError):
        make_plan(GPT2_124M, BatchConfig(seq_len=seq + 1, global_batch=8), memory)


def test_plan_that_needs_more_devices_names_how_many() -> None:
    with pytest.raises(PlanError) as err:  # 1.56B parameters: 28 GB of state on one 24 GB GPU
        make_plan(gpt2("gpt2-xl"), BatchConfig(seq_len=1024, global_batch=64), HardwareConfig(device="cuda", memory_gb=24))
    n = int(re.search(r"With FSDP over (\d+) devices", str(err.value)).group(1))
    fits = make_plan(gpt2("gpt2-xl"), BatchConfig(seq_len=1024, global_batch=64),
                     HardwareConfig(device="cuda", nproc_per_node=n, memory_gb=24))
    assert fits.parallelism == "fsdp"


def test_gpu_peak_table_and_measured_cpu_peak() -> None:
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("NVIDIA H200") == 989.4
    assert gpu_peak_tflops("Some Future GPU") is None
    assert 1e8 < measure_matmul_peak("cpu", seconds=0.05, n=256) < 1e14  # FLOP/s of this machine's cores


@pytest.mark.slow
@pytest.mark.parametrize("family", [{}], ids=["gpt2"])
def test_memory_estimate_is_within_25_percent_of_measured_peak(tmp_path, pretrain_job, train_runner, model_dict,
                                                               family) -> None:
    """A 3M-parameter model trains 3 steps on CPU; the planner's estimate is compared with the peak resident
    memory the run added (reported by kiln.train.loop), as the issue requires."""
    model = {**model_dict, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256, "dropout": 0.0, **family}
    job = pretrain_job(tmp_path, model=model, seq_len=128, micro_batch=16, max_steps=3, eval_interval=100,
                       eval_batches=1, ckpt_interval=100, keep_last=1, log_interval=1, peak_flops=-1)
    proc = train_runner(job)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((Path(json.loads(job.read_text())["out_dir"]) / "result.json").read_text())
    cfg = ModelConfig(**model)
    plan = make_plan(cfg, BatchConfig(seq_len=128, global_batch=16, micro_batch=16), HardwareConfig(memory_gb=16))
    estimate, measured = plan.memory_gb["total"], res["peak_memory_gb"]
    assert 0.15 < estimate < 0.3  # big enough that interpreter noise is small beside it
    assert abs(estimate - measured) / measured < 0.25, (estimate, measured, plan.memory_gb)


@pytest.mark.parametrize("family", [{}, {"family": "llama", "n_kv_head": 2, "intermediate_size": 512},
                                    {"family": "llama", "n_kv_head": 1, "qk_norm": True, "tie_embeddings": False}],
                         ids=["gpt2", "llama", "llama-qk-untied"])
def test_activation_estimate_is_within_15_percent_of_the_tensors_autograd_saves(family) -> None:
    """The planner's activation memory against the bytes autograd keeps for backward in one training forward
    (a deterministic count, unlike a process's peak resident memory)."""
    import torch

    from kiln.model.families import build_model

    cfg = ModelConfig(vocab_size=8192, block_size=128, n_layer=4, n_head=4, n_embd=256, **family)
    model, idx = build_model(cfg), torch.randint(0, 8192, (16, 128), generator=torch.Generator().manual_seed(0))
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, targets=idx)
    plan = make_plan(cfg, BatchConfig(seq_len=128, global_batch=16, micro_batch=16), HardwareConfig(memory_gb=16))
    measured = sum(saved.values()) / 2**30
    assert abs(plan.memory_gb["activations"] - measured) / measured < 0.15, (plan.memory_gb["activations"], measured)


def test_plan_from_config_picks_the_named_size_of_the_family() -> None:
    from kiln.common.config import ConfigError
    from kiln.plan.memory import plan_from_config

    batch = {"seq_len": 32, "global_batch": 4, "max_steps": 2}
    _, cfg, _, _ = plan_from_config(300, "tiny", {"family": "llama"}, batch, {"memory_gb": 16})
    assert (cfg.family, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.n_embd, cfg.vocab_size) == ("llama", 2, 4, 2, 64, 320)
    _, cfg, _, _ = plan_from_config(300, "tiny", {}, batch, {"memory_gb": 16})
    assert (cfg.family, cfg.n_head) == ("gpt2", 2)
    with pytest.raises(ConfigError, match="training_plan: model.n_kv_head applies to the llama and moe families only"):
        plan_from_config(300, "tiny", {"n_kv_head": 2}, batch)
    with pytest.raises(ConfigError, match="unknown model preset 'gpt2-xl' for family llama; choose one of tiny, demo"):
        plan_from_config(300, "gpt2-xl", {"family": "llama"}, batch)
    with pytest.raises(ConfigError, match="unknown family 'mamba'"):
        plan_from_config(300, "", {"family": "mamba"}, batch)


def test_a_plans_version_follows_what_the_run_does_not_the_planning_hosts_memory_or_cores() -> None:
    batch = BatchConfig(seq_len=32, global_batch=16, max_steps=10)
    here = make_plan(TINY, batch, HardwareConfig(device="cpu", nproc_per_node=1, memory_gb=8)).to_dict()
    bigger = make_plan(TINY, batch, HardwareConfig(device="cpu", nproc_per_node=1, memory_gb=64, peak_tflops=3.0)).to_dict()
    assert here["device_memory_gb"] != bigger["device_memory_gb"] and here["est_hours"] != bigger["est_hours"]
    assert plan_version(here) == plan_version(bigger)
    longer = make_plan(TINY, BatchConfig(seq_len=32, global_batch=16, max_steps=20),
                       HardwareConfig(device="cpu", nproc_per_node=1, memory_gb=8)).to_dict()
    assert plan_version(longer) != plan_version(here)
    assert plan_version({**here, "micro_batch": here["micro_batch"] // 2}) != plan_version(here)


@pytest.mark.parametrize("native", [True, False])
def test_a_cpu_plan_trains_under_bf16_autocast_where_the_cpu_multiplies_bf16_natively(monkeypatch, native) -> None:
    """cpu_bf16 unset follows the CPU (native_cpu_bf16); set, it is the user's; CUDA plans never carry it, and a plan
    without it has no cpu_bf16 key, so its version is what it was before the field existed."""
    import kiln.plan.memory as memory

    monkeypatch.setattr(memory, "native_cpu_bf16", lambda: native)
    cpu, batch = HardwareConfig(device="cpu", memory_gb=16), BatchConfig(seq_len=32, global_batch=8)
    auto = make_plan(TINY, batch, cpu)
    assert auto.cpu_bf16 is (True if native else None)
    assert ("cpu_bf16" in auto.to_dict()) is native
    assert ("bf16 autocast on CPU" in memory.describe_plan(auto)) is native
    assert make_plan(TINY, batch, cpu, ParallelConfig(cpu_bf16=True)).cpu_bf16 is True
    off = make_plan(TINY, batch, cpu, ParallelConfig(cpu_bf16=False))
    assert "cpu_bf16" not in off.to_dict()
    if not native:  # off and unset on an AVX2 CPU are one plan
        assert plan_version(off.to_dict()) == plan_version(auto.to_dict())
    gpu = make_plan(TINY, batch, HardwareConfig(**H100), ParallelConfig(cpu_bf16=True))
    assert "cpu_bf16" not in gpu.to_dict()


def test_native_cpu_bf16_reads_torchs_cpu_probes(monkeypatch) -> None:
    """AVX-512 BF16 or AMX tiles count as native bf16; neither (an AVX2 CPU) does not, nor do they where torch's
    kernels are held to AVX2 (ATEN_CPU_CAPABILITY=avx2)."""
    import torch

    for capability, bf16, amx, want in [("AVX512", True, False, True), ("AVX512", False, True, True),
                                        ("AVX512", False, False, False), ("AVX2", True, True, False)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert native_cpu_bf16() is want, capability
