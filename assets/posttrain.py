"""Step 9 as assets: instruction pairs from public data and the supervised fine-tuned model."""


import re
from typing import Any

import pyarrow.parquet as pq
from dagster import AssetExecutionContext, Config, MetadataValue, Output, asset
from pydantic import Field

from assets._common import commit_output, data_version, md_table, mlflow_meta
from assets.training import run_training
from kiln import instructions as kinst
from kiln.checkpoint import load_for_inference
from kiln.sft import chat_prompt_ids, read_pairs
from kiln.storage import staging_dir
from kiln.tracking import MetricLogger
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource


class InstructionDataConfig(Config):
    n_arithmetic: int = Field(default=4000, description="Addition/subtraction problems with exact answers.")
    max_doc_pairs: int = Field(default=3000, description="At most this many documentation heading -> section pairs.")
    val_permille: int = Field(default=50, description="Pairs per thousand (by prompt hash) held out for evaluation.")
    seed: int = Field(default=7, description="Seed for generated problems.")


@asset(code_version="1", group_name="posttraining")
def instruction_data(context: AssetExecutionContext, config: InstructionDataConfig, raw_documents: dict,
                     storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Instruction/response pairs built honestly from public data: documentation heading -> its section, and arithmetic with checkable answers."""
    t = pq.read_table(raw_documents["path"], columns=["id", "text", "content_type"])
    html = [(i, x) for i, x, c in zip(t.column("id").to_pylist(), t.column("text").to_pylist(),
                                      t.column("content_type").to_pylist()) if c == "text/html"]
    with mlflow.asset_run(context, params=config.model_dump(), tags={"input.raw_documents": raw_documents["version"]}) as run, \
            staging_dir(storage.path("instruction_data")) as stage:
        pairs = kinst.build_pairs(html, config.n_arithmetic, config.seed, config.val_permille, config.max_doc_pairs)
        kinst.write_jsonl(pairs, stage / "pairs.jsonl")
        final, version = commit_output(stage, storage.path("instruction_data"))
        counts: dict[str, dict[str, int]] = {}
        for p in pairs:
            counts.setdefault(p["kind"], {"train": 0, "val": 0})[p["split"]] += 1
        run.log_metrics({"pairs": len(pairs)})
        examples = [next(p for p in pairs if p["kind"] == k) for k in counts]
        return Output({"path": str(final / "pairs.jsonl"), "version": version, "counts": counts},
                      data_version=data_version(version), metadata={
            "pairs": len(pairs), "by_kind": md_table([{"kind": k, **v} for k, v in counts.items()]),
            "examples": md_table([{"prompt": e["prompt"], "response": e["response"][:160]} for e in examples]),
            "path": MetadataValue.path(str(final / "pairs.jsonl")), **mlflow_meta(run),
        })


class SftModelConfig(Config):
    optim: dict[str, Any] = Field(default_factory=lambda: {"lr": 5e-4, "warmup_steps": 20, "min_lr_ratio": 0.1},
                                  description="kiln.train.OptimConfig fields for fine-tuning.")
    max_steps: int = Field(default=150, description="Fine-tuning optimizer steps.")
    micro_batch: int = Field(default=16, description="Packed sequences per rank per step.")
    eval_interval: int = Field(default=50, description="Steps between masked validation-loss passes.")
    eval_items: int = Field(default=100, description="Held-out arithmetic problems answered before and after.")
    seed: int = Field(default=1337, description="Seed for data order.")


def arithmetic_accuracy(model, enc, pairs: list[dict]) -> float:
    """Share of held-out arithmetic prompts whose greedy answer ends with the exact number."""
    import torch

    if not pairs:
        return float("nan")
    correct = 0
    for p in pairs:
        ids = torch.tensor([chat_prompt_ids(enc, p["prompt"])])
        out = model.generate(ids, max_new_tokens=16, temperature=0, stop_token=enc.eot_token)[0, ids.size(1):].tolist()
        text = enc.decode([t for t in out if t != enc.eot_token])
        nums = re.findall(r"-?\d+", text)
        correct += bool(nums) and nums[-1] == p["answer"]
    return correct / len(pairs)


@asset(code_version="1", group_name="posttraining")
def sft_model(context: AssetExecutionContext, config: SftModelConfig, base_model: dict, instruction_data: dict,
              training_plan: dict, tokenizer: dict, storage: KilnStorageResource, torchrun: TorchrunResource,
              mlflow: MlflowResource) -> Output[dict]:
    """The base model fine-tuned on instruction pairs (loss on response tokens only) by a torchrun job; held-out accuracy before and after."""
    world = training_plan["world_size"]
    plan = {**training_plan, "micro_batch": config.micro_batch, "grad_accum": 1}
    fields = {"optim": config.optim, "train_files": [instruction_data["path"]], "val_files": [instruction_data["path"]],
              "max_steps": config.max_steps, "eval_interval": config.eval_interval, "eval_batches": 8,
              "ckpt_interval": config.max_steps, "keep_last": 1, "log_interval": 25, "seed": config.seed,
              "init_from": base_model["checkpoint"]}
    held = [p for p in read_pairs(instruction_data["path"], "val") if p["kind"] == "arithmetic"][: config.eval_items]
    model, enc, _ = load_for_inference(base_model["checkpoint"])
    before = arithmetic_accuracy(model, enc, held)
    out = run_training(context, "sft", fields, plan, {"base_model": base_model["version"],
                       "instruction_data": instruction_data["version"]}, storage, torchrun, mlflow, tokenizer["path"])
    model, enc, _ = load_for_inference(out.value["checkpoint"])
    after = arithmetic_accuracy(model, enc, held)
    comparison = [{"measure": "held-out arithmetic exact match", "before": before, "after": after},
                  {"measure": "masked response loss (val)", "before": out.value["initial_val_loss"], "after": out.value["final_val_loss"]}]
    context.log.info(f"SFT on {world} rank(s): arithmetic accuracy {before:.3f} -> {after:.3f}")
    tracker = MetricLogger(mlflow.resolved_uri(), out.value["mlflow_run_id"])
    tracker.log({"arithmetic_acc_before": before, "arithmetic_acc_after": after}, out.value["steps"])
    tracker.flush()
    value = {**out.value, "before_after": comparison}
    return Output(value, data_version=out.data_version, metadata={**out.metadata, "before_after": md_table(comparison)})
