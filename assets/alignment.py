"""Step 9 as assets: instruction and preference data, then SFT -> DPO -> RL, each evaluated before and after."""


from pathlib import Path
from typing import Any, Callable

import pyarrow.parquet as pq
from dagster import AssetExecutionContext, Config, MetadataValue, Output, asset
from pydantic import Field

from assets._common import commit_output, line_plot, md_table, mlflow_meta
from assets.training import run_training
from kiln.posttrain import instructions as kinst
from kiln.train.checkpoint import checkpoint_identity, load_for_inference
from kiln.common.config import from_dict
from kiln.evaluation.contamination import DEFAULT_N
from kiln.model.lora import LoRAConfig
from kiln.posttrain.common import MEASURES, comparison_rows, measure
from kiln.posttrain.preferences import build_preferences
from kiln.posttrain.sft import read_pairs
from kiln.shards import split_of
from kiln.common.files import stable_hash, staging_dir
from kiln.common.metrics import MetricLogger
from kiln.train.loop import OptimConfig
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource


class InstructionDataConfig(Config):
    n_arithmetic: int = Field(default=4000, description="Addition/subtraction problems with exact answers (duplicates dropped).")
    max_operand: int = Field(default=20, description="Largest operand of the arithmetic problems (small enough for the demo model to learn some).")
    max_doc_pairs: int = Field(default=3000, description="At most this many documentation heading -> section pairs.")
    val_permille: int = Field(default=50, description="Pairs per thousand (by prompt hash) held out for evaluation.")
    seed: int = Field(default=7, description="Seed for generated problems.")
    overlap_words: int = Field(default=DEFAULT_N, description="Drop a pair sharing this many consecutive words with an eval_suite item (the contamination report's n).")
    eval_items: int = Field(default=100, description="Held-out items per measure that every post-training stage is scored on, before and after.")


@asset(code_version="1", group_name="posttraining")
def instruction_data(context: AssetExecutionContext, config: InstructionDataConfig, raw_documents: dict, token_shards: dict,
                     eval_suite: dict, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Instruction/response pairs built honestly from public data: documentation heading -> its section, and arithmetic with checkable answers; held-out pages are skipped and pairs sharing an n-gram with any eval_suite item dropped."""
    vp = token_shards["val_permille"]
    t = pq.read_table(raw_documents["path"], columns=["id", "text", "content_type"])
    html = [(i, x) for i, x, c in zip(t.column("id").to_pylist(), t.column("text").to_pylist(),
                                      t.column("content_type").to_pylist()) if c == "text/html"]
    train_html = [(i, x) for i, x in html if split_of(i, vp) == "train"]  # held-out pages are evaluation material
    evals = kinst.EvalOverlap.from_task_dir(eval_suite["dir"], config.overlap_words)
    with mlflow.asset_run(context, params=config.model_dump(), tags={"input.raw_documents": raw_documents["version"],
                                                                      "input.eval_suite": eval_suite["version"]},
                          reuse={"config": config.model_dump(), "raw_documents": raw_documents["version"],
                                 "eval_suite": eval_suite["version"], "val_permille": vp}) as run, \
            staging_dir(storage.path("instruction_data")) as stage:
        if run.reused is not None:
            return run.reused
        dropped: list[dict] = []
        pairs = kinst.build_pairs(train_html, config.n_arithmetic, config.seed, config.val_permille, config.max_doc_pairs,
                                  exclude=evals, dropped=dropped, max_operand=config.max_operand)
        if not pairs:
            raise ValueError("instruction_data: no pairs left; raise n_arithmetic or max_doc_pairs, or add HTML sources")
        kinst.write_jsonl(pairs, stage / "pairs.jsonl")
        final, version = commit_output(stage, storage.path("instruction_data"))
        counts: dict[str, dict[str, int]] = {}
        for p in pairs:
            counts.setdefault(p["kind"], {"train": 0, "val": 0})[p["split"]] += 1
        decontam = {"held_out_pages_skipped": len(html) - len(train_html), "pairs_sharing_eval_ngrams": len(dropped),
                    "eval_items_checked": evals.items, "ngram_words": evals.n}
        run.log_metrics({"pairs": len(pairs), **decontam})
        examples = [next(p for p in pairs if p["kind"] == k) for k in counts]
        value = {"path": str(final / "pairs.jsonl"), "version": version, "counts": counts, "eval_items": config.eval_items,
                 "decontamination": decontam}
        return run.output(value, version, {
            "pairs": len(pairs), "by_kind": md_table([{"kind": k, **v} for k, v in counts.items()]),
            "decontamination": md_table([{"check": k, "count": v} for k, v in decontam.items()]),
            "dropped_examples": md_table([{"prompt": d["prompt"], "reason": d["reason"]} for d in dropped[:5]]),
            "examples": md_table([{"prompt": e["prompt"], "response": e["response"][:160]} for e in examples]),
            "path": MetadataValue.path(str(final / "pairs.jsonl")), **mlflow_meta(run),
        })


class PreferenceDataConfig(Config):
    seed: int = Field(default=0, description="Seed for choosing wrong answers and other sections.")


@asset(code_version="1", group_name="posttraining")
def preference_data(context: AssetExecutionContext, config: PreferenceDataConfig, instruction_data: dict,
                    storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Preference pairs from the instruction pairs: the correct response chosen, a checkably wrong one rejected (a wrong sum, another heading's section); each keeps its prompt's split."""
    prefs = build_preferences(read_pairs(instruction_data["path"]), config.seed)
    if not prefs:
        raise ValueError(f"{instruction_data['path']}: no instruction pairs of a kind that yields preferences "
                         "(arithmetic, doc_section); raise instruction_data.n_arithmetic")
    with mlflow.asset_run(context, params=config.model_dump(), tags={"input.instruction_data": instruction_data["version"]},
                          reuse={"config": config.model_dump(), "instruction_data": instruction_data["version"]}) as run, \
            staging_dir(storage.path("preference_data")) as stage:
        if run.reused is not None:
            return run.reused
        kinst.write_jsonl(prefs, stage / "preferences.jsonl")
        final, version = commit_output(stage, storage.path("preference_data"))
        counts: dict[str, dict[str, int]] = {}
        for p in prefs:
            counts.setdefault(p["error"], {"train": 0, "val": 0})[p["split"]] += 1
        run.log_metrics({"pairs": len(prefs)})
        examples = [next(p for p in prefs if p["error"] == k) for k in counts]
        return run.output({"path": str(final / "preferences.jsonl"), "version": version, "counts": counts}, version, {
            "pairs": len(prefs), "by_rejection": md_table([{"rejected_because": k, **v} for k, v in counts.items()]),
            "examples": md_table([{"prompt": e["prompt"], "chosen": e["chosen"][:100], "rejected": e["rejected"][:100]}
                                  for e in examples]),
            "path": MetadataValue.path(str(final / "preferences.jsonl")), **mlflow_meta(run),
        })


def heldout_suite(instruction_data: dict, preference_data: dict) -> dict[str, list[dict]]:
    """The fixed held-out items every stage is measured on (the same lists before and after, for every stage)."""
    n = instruction_data["eval_items"]
    val = read_pairs(instruction_data["path"], "val")
    return {"arithmetic": [p for p in val if p["kind"] == "arithmetic"][:n], "instructions": val[:n],
            "preferences": read_pairs(preference_data["path"], "val")[:n]}


def suite_key(suite: dict[str, list[dict]]) -> str:
    return stable_hash(suite)[:16]


def measure_checkpoint(checkpoint: str, suite: dict[str, list[dict]], device: str) -> dict[str, float]:
    """The held-out measures of one checkpoint (on the GPU when the plan trains on one)."""
    import torch

    dev = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    model, enc, _ = load_for_inference(checkpoint, dev)
    threads = torch.get_num_threads()
    if dev == "cpu":  # small latency-bound batches: one thread avoids synchronisation that costs more than it saves
        torch.set_num_threads(1)
    try:
        return measure(model, enc, suite["arithmetic"], suite["preferences"], suite["instructions"], device=dev)
    finally:
        torch.set_num_threads(threads)


def measure_before(init: dict, suite: dict[str, list[dict]], device: str) -> dict[str, float]:
    """The starting model's measures: the previous stage's "after" when it was taken on this same suite."""
    if init.get("suite_key") == suite_key(suite) and init.get("after"):
        return dict(init["after"])
    return measure_checkpoint(init["checkpoint"], suite, device)


def stage_rows(sft: dict, dpo: dict, rl: dict) -> list[dict[str, Any]]:
    """One row per measure with a column per model: base (before SFT), then after SFT, DPO and RL."""
    cols = {"base": sft["before"], "sft": sft["after"], "dpo": dpo["after"], "rl": rl["after"]}
    return [{"measure": m, **{c: v[m] for c, v in cols.items()}} for m in MEASURES if all(m in v for v in cols.values())]


def before_after(context, before: dict, after: dict, tracking_uri: str, run_id: str, step: int) -> tuple[list[dict], dict]:
    """The side-by-side rows, logged to the stage's MLflow run as before.<m> / after.<m> and a JSON table."""
    rows = comparison_rows(before, after)
    tracker = MetricLogger(tracking_uri, run_id)
    tracker.log({**{f"before.{k}": v for k, v in before.items()}, **{f"after.{k}": v for k, v in after.items()}}, step)
    tracker.flush()
    if tracker.client is not None:
        tracker.client.log_dict(run_id, {"rows": rows, "measures": MEASURES}, "before_after.json")
    context.log.info("before -> after: " + "; ".join(f"{r['measure']} {r['before']:.3f} -> {r['after']:.3f}" for r in rows))
    meta = {"before_after": md_table([{**r, "what": MEASURES[r["measure"]]} for r in rows])}
    return rows, meta


class SftModelConfig(Config):
    optim: dict[str, Any] = Field(default_factory=lambda: {"lr": 2e-3, "warmup_steps": 20, "min_lr_ratio": 0.1},
                                  description="kiln.train.loop.OptimConfig fields for fine-tuning.")
    max_steps: int = Field(default=150, description="Fine-tuning optimizer steps.")
    micro_batch: int = Field(default=16, description="Packed sequences per rank per step.")
    eval_interval: int = Field(default=50, description="Steps between masked validation-loss passes.")
    seed: int = Field(default=1337, description="Seed for data order.")


@asset(code_version="1", group_name="posttraining")
def sft_model(context: AssetExecutionContext, config: SftModelConfig, base_model: dict, instruction_data: dict,
              preference_data: dict, training_plan: dict, tokenizer: dict, storage: KilnStorageResource,
              torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """The base model fine-tuned on instruction pairs (loss on response tokens only, packed sequences, its own schedule) by a torchrun job; held-out measures before and after."""
    plan = {**training_plan, "micro_batch": config.micro_batch, "grad_accum": 1}
    fields = {"optim": config.optim, "train_files": [instruction_data["path"]], "val_files": [instruction_data["path"]],
              "max_steps": config.max_steps, "eval_interval": config.eval_interval, "eval_batches": 8,
              "ckpt_interval": config.max_steps, "keep_last": 1, "log_interval": 25, "seed": config.seed,
              "init_from": base_model["checkpoint"]}
    suite = heldout_suite(instruction_data, preference_data)
    device = training_plan["hardware"]["device"]
    before = measure_before(base_model, suite, device)
    out = run_training(context, "sft", fields, plan, {"base_model": base_model["version"],
                       "instruction_data": instruction_data["version"]}, storage, torchrun, mlflow, tokenizer["path"])
    after = measure_checkpoint(out.value["checkpoint"], suite, device)
    rows, meta = before_after(context, before, after, mlflow.resolved_uri(), out.value["mlflow_run_id"], out.value["steps"])
    value = {**out.value, "before": before, "after": after, "before_after": rows, "suite_key": suite_key(suite)}
    return Output(value, data_version=out.data_version, metadata={**out.metadata, **meta})


def run_stage(context, task: str, fields: dict[str, Any], plan: dict, init: dict, key_inputs: dict[str, str],
              suite: dict[str, list[dict]], tokenizer_path: str, storage: KilnStorageResource, torchrun: TorchrunResource,
              mlflow: MlflowResource, describe: Callable[[dict, Any], dict]) -> Output[dict]:
    """Measure ``init`` on the held-out suite, launch the DPO or RL torchrun job (its folder keyed by its inputs, so
    a rerun resumes), measure the result; ``describe(value, run)`` adds the stage's own plots and tables."""
    asset_name = context.asset_key.to_user_string()
    from_dict(OptimConfig, fields.get("optim", {}), f"{asset_name}.optim")
    from_dict(LoRAConfig, fields.get("lora", {}), f"{asset_name}.lora")
    device = plan["hardware"]["device"]
    key = stable_hash({"task": task, **key_inputs, **fields, "plan": plan})[:16]  # the run folder: same key resumes
    out_dir = storage.path(asset_name, key)
    with mlflow.asset_run(context, params={**fields, "plan": {k: plan[k] for k in ("micro_batch", "world_size")}},
                          tags={f"input.{k}": v for k, v in key_inputs.items()},
                          reuse={"key": key, "suite": suite_key(suite)}) as run:
        if run.reused is not None:
            return run.reused
        before = measure_before(init, suite, device)
        job = {"task": task, "out_dir": str(out_dir), "tokenizer": tokenizer_path, "model": plan["model"],
               "seq_len": plan["seq_len"], "init_from": init["checkpoint"], "mlflow_tracking_uri": run.tracking_uri,
               "mlflow_run_id": run.run_id, **fields}
        result = torchrun.launch(context, job, plan["hardware"]["nproc_per_node"], device)
        ckpt = Path(result["checkpoint"])
        after = measure_checkpoint(str(ckpt), suite, device)
        rows, meta = before_after(context, before, after, run.tracking_uri, run.run_id, result["steps"])
        run.set_tags({"checkpoint": str(ckpt)})
        value = {**result, "out_dir": str(out_dir), "version": checkpoint_identity(ckpt),
                 "mlflow_run_id": run.run_id, "before": before, "after": after, "before_after": rows,
                 "suite_key": suite_key(suite)}
        meta.update({"checkpoint": MetadataValue.path(str(ckpt)), "steps": result["steps"], "wall_s": round(result["wall_s"], 1),
                     "resumed_from": str(result["resumed_from"]), "world_size": result["world_size"], "device": result["device"],
                     "trainable_parameters": result["trainable_params"], "lora": result["lora"]["enabled"], **mlflow_meta(run)})
        meta.update(describe(value, run))
        return run.output(value, value["version"], meta)


class DpoModelConfig(Config):
    optim: dict[str, Any] = Field(default_factory=lambda: {"lr": 1e-4, "warmup_steps": 10, "min_lr_ratio": 0.1, "weight_decay": 0.0},
                                  description="kiln.train.loop.OptimConfig fields for DPO.")
    beta: float = Field(default=0.1, description="DPO beta: how strongly the policy is held to the reference (larger = closer).")
    label_smoothing: float = Field(default=0.0, description="Assumed share of flipped preference labels (conservative DPO); 0 is plain DPO.")
    max_steps: int = Field(default=60, description="DPO optimizer steps.")
    micro_batch: int = Field(default=16, description="Preference pairs per rank per step.")
    eval_interval: int = Field(default=25, description="Steps between held-out reward-margin passes.")
    eval_pairs: int = Field(default=256, description="Held-out pairs scored at each pass.")
    lora: dict[str, Any] = Field(default_factory=dict, description="kiln.model.lora.LoRAConfig fields; {enabled: true, rank: 8} trains adapters only (merged into the saved weights).")
    seed: int = Field(default=1337, description="Seed for data order.")


@asset(code_version="1", group_name="posttraining")
def dpo_model(context: AssetExecutionContext, config: DpoModelConfig, sft_model: dict, preference_data: dict,
              instruction_data: dict, training_plan: dict, tokenizer: dict, storage: KilnStorageResource,
              torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """The SFT model trained by Direct Preference Optimization against itself frozen as the reference (a torchrun job), reporting reward margins and chosen/rejected log-probabilities; held-out measures before and after."""
    plan = {**training_plan, "micro_batch": config.micro_batch}
    fields = {"optim": config.optim, "lora": config.lora, "train_files": [preference_data["path"]], "beta": config.beta,
              "label_smoothing": config.label_smoothing, "max_steps": config.max_steps, "micro_batch": config.micro_batch,
              "eval_interval": config.eval_interval, "eval_pairs": config.eval_pairs, "ckpt_interval": config.max_steps,
              "keep_last": 1, "log_interval": 25, "seed": config.seed}
    return run_stage(context, "dpo", fields, plan, sft_model,
                     {"sft_model": sft_model["version"], "preference_data": preference_data["version"]},
                     heldout_suite(instruction_data, preference_data), tokenizer["path"], storage, torchrun, mlflow,
                     describe_dpo)


def describe_dpo(value: dict, run) -> dict[str, Any]:
    hist = value["history"]
    series = lambda key: [(h["step"], h[key]) for h in hist if h.get(key) is not None]  # noqa: E731
    out_dir = Path(value["out_dir"])
    meta = {
        "reward_margin_curve": line_plot({"train margin": series("train_reward_margin"), "held-out margin": series("val_reward_margin")},
                                         "DPO reward margin", "step", "beta * log-ratio difference", save_to=out_dir / "margins.png"),
        "logps_curve": line_plot({"chosen": series("val_chosen_logp"), "rejected": series("val_rejected_logp")},
                                 "held-out log-probabilities", "step", "summed log p(response)", save_to=out_dir / "logps.png"),
        "held_out_pairs": md_table(hist, ["step", "train_loss", "train_reward_accuracy", "val_loss", "val_reward_accuracy",
                                          "val_reward_margin", "val_chosen_logp", "val_rejected_logp"]),
        "final_held_out": md_table([{"quantity": k, "start": (value["initial_val"] or {}).get(k), "end": v}
                                    for k, v in (value["final_val"] or {}).items()]),
    }
    run.log_artifact(out_dir / "margins.png")
    run.log_artifact(out_dir / "logps.png")
    return meta


class RlModelConfig(Config):
    optim: dict[str, Any] = Field(default_factory=lambda: {"lr": 3e-5, "warmup_steps": 5, "min_lr_ratio": 0.5, "weight_decay": 0.0},
                                  description="kiln.train.loop.OptimConfig fields for RL.")
    reward: str = Field(default="arithmetic", description="Checkable task whose exact answers give the reward (kiln.posttrain.rl.REWARDS).")
    max_steps: int = Field(default=60, description="RL optimizer steps.")
    prompts_per_step: int = Field(default=8, description="Prompts per rank per step.")
    group_size: int = Field(default=8, description="Answers sampled per prompt; advantages are relative within the group.")
    max_new_tokens: int = Field(default=16, description="Longest sampled answer, in tokens.")
    temperature: float = Field(default=0.7, description="Sampling temperature.")
    partial_credit: float = Field(default=0.2, description="Reward scale for a near miss (a wrong answer within 10 of the right one); 0 rewards exact answers only.")
    kl_coef: float = Field(default=0.1, description="Weight of the per-token KL penalty to the reference (the DPO model).")
    eval_interval: int = Field(default=20, description="Steps between greedy held-out reward passes.")
    eval_items: int = Field(default=100, description="Held-out prompts in each reward pass.")
    lora: dict[str, Any] = Field(default_factory=dict, description="kiln.model.lora.LoRAConfig fields; {enabled: true} trains adapters only.")
    seed: int = Field(default=1337, description="Seed for prompt order and sampling.")


@asset(code_version="1", group_name="posttraining")
def rl_model(context: AssetExecutionContext, config: RlModelConfig, dpo_model: dict, instruction_data: dict,
             preference_data: dict, training_plan: dict, tokenizer: dict, storage: KilnStorageResource,
             torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """The DPO model trained by reinforcement learning on checkable arithmetic (GRPO-style group-relative advantages, KL penalty to the DPO model) by a torchrun job; reward over steps, held-out measures before and after."""
    plan = {**training_plan, "micro_batch": config.prompts_per_step}
    fields = {"optim": config.optim, "lora": config.lora, "train_files": [instruction_data["path"]], "reward": config.reward,
              "max_steps": config.max_steps, "micro_batch": config.prompts_per_step, "group_size": config.group_size,
              "max_new_tokens": config.max_new_tokens, "temperature": config.temperature, "kl_coef": config.kl_coef,
              "partial_credit": config.partial_credit,
              "eval_interval": config.eval_interval, "eval_items": config.eval_items, "ckpt_interval": config.max_steps,
              "keep_last": 1, "log_interval": 10, "seed": config.seed}
    return run_stage(context, "rl", fields, plan, dpo_model,
                     {"dpo_model": dpo_model["version"], "instruction_data": instruction_data["version"]},
                     heldout_suite(instruction_data, preference_data), tokenizer["path"], storage, torchrun, mlflow,
                     describe_rl)


def describe_rl(value: dict, run) -> dict[str, Any]:
    hist = value["history"]
    out_dir = Path(value["out_dir"])
    meta = {
        "reward_curve": line_plot({"sampled reward (train)": [(h["step"], h["reward"]) for h in hist if "reward" in h],
                                   "sampled exact answers (train)": [(h["step"], h["exact_answer"]) for h in hist if "exact_answer" in h],
                                   "greedy held-out reward": [(h["step"], h["val_reward"]) for h in hist if "val_reward" in h]},
                                  "RL reward over steps", "step", "mean reward", save_to=out_dir / "reward.png"),
        "kl_curve": line_plot({"KL to reference": [(h["step"], h["kl"]) for h in hist if "kl" in h]},
                              "KL to the reference", "step", "nats/token", save_to=out_dir / "kl.png"),
        "held_out_reward": md_table([{"step": h["step"], "reward": h["val_reward"]} for h in hist if "val_reward" in h]),
    }
    run.log_artifact(out_dir / "reward.png")
    run.log_artifact(out_dir / "kl.png")
    return meta
