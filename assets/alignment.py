"""Step 9 as assets: instruction and preference data, then SFT -> DPO -> RL, each evaluated before and after."""


from typing import Annotated, Any, Callable, Optional, Union

from dagster import AssetExecutionContext, Failure, MetadataValue, Output, asset
from pydantic import Field

from assets._common import asset_output, failing_on_config_errors, md_table, report_metadata
from assets._config import KilnConfig, block_defaults, schema_of
from assets.pretrained import import_folder, lineage_of
from assets.training import Lora
from kiln.common.config import Domain
from kiln.evaluation.contamination import DEFAULT_N
from kiln.model.config import ModelConfig
from kiln.posttrain import instructions as kinst
from kiln.posttrain.measures import (comparison_line, comparison_table, heldout_suite, log_comparison, means,
                                     measure_before, measure_checkpoint, suite_key)
from kiln.posttrain.dpo import DpoJob
from kiln.posttrain.preference_losses import LOSS_FIELDS
from kiln.posttrain.preferences import build_preferences, check_feedback, feedback_files, pairs_by_source
from kiln.posttrain.report import dpo_report, rl_report
from kiln.posttrain.rl import RL_SETTINGS, RlJob
from kiln.posttrain.sft import read_pairs
from kiln.pretrained.source import is_importable
from kiln.train.checkpoint import checkpoint_identity, resolve_checkpoint
from kiln.train.job import SftJob
from kiln.train.launch import RunSpec, Table, pretrain_report
from kiln.train.optim import OptimConfig
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource


class InstructionDataConfig(KilnConfig):
    n_arithmetic: Annotated[int, Domain(0)] = Field(default=4000, description="Addition/subtraction problems with exact answers (duplicates dropped).")
    max_operand: Annotated[int, Domain(1)] = Field(default=20, description="Largest operand of the arithmetic problems (small enough for the demo model to learn some).")
    max_doc_pairs: Annotated[int, Domain(0)] = Field(default=3000, description="At most this many documentation heading -> section pairs.")
    val_permille: Annotated[int, Domain(0, 1000)] = Field(default=50, description="Pairs per thousand (by prompt hash) held out for evaluation.")
    arithmetic_val_permille: Annotated[int, Domain(0, 1000)] = Field(default=200, description="The same for arithmetic problems: there are only 2 x (max_operand + 1)^2 distinct ones, so a larger share is held out to measure each stage on enough of them.")
    seed: Annotated[int, Domain(0)] = Field(default=7, description="Seed for generated problems.")
    overlap_words: Annotated[int, Domain(1)] = Field(default=DEFAULT_N, description="Drop a pair sharing this many consecutive words with an eval_suite item (the contamination report's n).")
    eval_items: Annotated[int, Domain(1)] = Field(default=200, description="Held-out items per measure (at most) that every post-training stage is scored on, before and after; each change is shown with its paired standard error over them. The demo holds out 167 arithmetic problems and 175 other pairs.")


@asset(code_version="1", group_name="posttraining")
def instruction_data(context: AssetExecutionContext, config: InstructionDataConfig, raw_documents: dict, token_shards: dict,
                     eval_suite: dict, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Instruction/response pairs built honestly from public data: documentation heading -> its section, and arithmetic with checkable answers; held-out pages are skipped and pairs sharing an n-gram with any eval_suite item dropped."""
    vp = token_shards["val_permille"]
    n_html, train_html = kinst.training_pages(raw_documents["path"], vp)
    evals = kinst.EvalOverlap.from_task_dir(eval_suite["dir"], config.overlap_words)
    with asset_output(context, mlflow, parent=storage.path("instruction_data"), config=config,
                      inputs={"raw_documents": raw_documents, "eval_suite": eval_suite}, reuse={"val_permille": vp}) as out:
        if out.reused:
            return out.reused
        dropped: list[dict] = []
        pairs = kinst.build_pairs(train_html, config.n_arithmetic, config.seed, config.val_permille, config.max_doc_pairs,
                                  exclude=evals, dropped=dropped, max_operand=config.max_operand,
                                  kind_val_permille={"arithmetic": config.arithmetic_val_permille})
        if not pairs:
            raise ValueError("instruction_data: no pairs left; raise n_arithmetic or max_doc_pairs, or add HTML sources")
        kinst.write_jsonl(pairs, out.stage / "pairs.jsonl")
        path = str(out.commit() / "pairs.jsonl")
        counts = kinst.split_counts(pairs, "kind")
        decontam = {"held_out_pages_skipped": n_html - len(train_html), "pairs_sharing_eval_ngrams": len(dropped),
                    "eval_items_checked": evals.items, "ngram_words": evals.n}
        out.log_metrics({"pairs": len(pairs), **decontam})
        value = {"path": path, "version": out.version, "counts": counts, "eval_items": config.eval_items,
                 "decontamination": decontam}
        return out.result(value, {
            "pairs": len(pairs), "by_kind": md_table([{"kind": k, **v} for k, v in counts.items()]),
            "decontamination": md_table([{"check": k, "count": v} for k, v in decontam.items()]),
            "dropped_examples": md_table([{"prompt": d["prompt"], "reason": d["reason"]} for d in dropped[:5]]),
            "examples": md_table([{"prompt": e["prompt"], "response": e["response"][:160]}
                                  for e in kinst.first_of_each(pairs, "kind")]),
            "path": MetadataValue.path(path),
        })


class PreferenceDataConfig(KilnConfig):
    seed: Annotated[int, Domain(0)] = Field(default=0, description="Seed for choosing wrong answers and other sections.")


@asset(code_version="1", group_name="posttraining")
def preference_data(context: AssetExecutionContext, config: PreferenceDataConfig, instruction_data: dict,
                    storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Preference pairs from the instruction pairs: the correct response chosen, a checkably wrong one rejected (a wrong sum, another heading's section); each keeps its prompt's split."""
    prefs = build_preferences(read_pairs(instruction_data["path"]), config.seed)
    if not prefs:
        raise ValueError(f"{instruction_data['path']}: no instruction pairs of a kind that yields preferences "
                         "(arithmetic, doc_section); raise instruction_data.n_arithmetic")
    with asset_output(context, mlflow, parent=storage.path("preference_data"), config=config,
                      inputs={"instruction_data": instruction_data}) as out:
        if out.reused:
            return out.reused
        kinst.write_jsonl(prefs, out.stage / "preferences.jsonl")
        path = str(out.commit() / "preferences.jsonl")
        counts = kinst.split_counts(prefs, "error")
        out.log_metrics({"pairs": len(prefs)})
        return out.result({"path": path, "version": out.version, "counts": counts}, {
            "pairs": len(prefs), "by_rejection": md_table([{"rejected_because": k, **v} for k, v in counts.items()]),
            "examples": md_table([{"prompt": e["prompt"], "chosen": e["chosen"][:100], "rejected": e["rejected"][:100]}
                                  for e in kinst.first_of_each(prefs, "error")]),
            "path": MetadataValue.path(path),
        })


def init_from_field():
    return Field(default="", description="Start from these weights instead of the previous stage's: a local Hugging "
                 "Face folder (config.json, safetensors, tokenizer.json; the same architecture and tokenizer as the "
                 "run's, e.g. pretrained_model.path's or a fine-tune of it) or a Kiln checkpoint. Empty: the previous stage.")


def start_weights(stage: str, init_from: str, upstream: dict, training_plan: dict, tokenizer: dict,
                  storage: KilnStorageResource) -> tuple[dict, dict, dict]:
    """(the starting model as measure_before takes it, the run-key input naming it, fields for the asset's value):
    the upstream stage's output, or ``init_from`` (a Hugging Face folder or GGUF file, imported once; or a Kiln
    checkpoint)."""
    if not init_from:
        return upstream, {}, {}
    if not is_importable(init_from):
        ckpt = resolve_checkpoint(init_from)
        return {"checkpoint": str(ckpt)}, {"init_from": checkpoint_identity(ckpt)}, {"init_from": str(ckpt)}
    rec = import_folder(storage, init_from, f"{stage}.init_from")
    if rec["fingerprint"] != tokenizer["fingerprint"] or ModelConfig(**rec["model"]) != ModelConfig(**training_plan["model"]):
        what = "tokenizer" if rec["fingerprint"] != tokenizer["fingerprint"] else "architecture"
        raise Failure(description=f"{stage}.init_from: {init_from} has another {what} than this run's; set "
                      f"pretrained_model.path to {init_from} (or a folder with the same {what})", allow_retries=False)
    return ({"checkpoint": rec["checkpoint"]}, {"init_from": rec["version"]},
            {"init_from": rec["checkpoint"], "pretrained": lineage_of(rec)})


SftOptim = schema_of(OptimConfig, defaults=block_defaults(SftJob, "optim"), name="SftOptim")
DpoOptim = schema_of(OptimConfig, defaults=block_defaults(DpoJob, "optim"), name="DpoOptim")
RlOptim = schema_of(OptimConfig, defaults=block_defaults(RlJob, "optim"), name="RlOptim")


class SftModelConfig(schema_of(SftJob, include=("max_steps", "micro_batch", "eval_interval", "seed"),
                               name="SftJobFields")):
    optim: SftOptim = Field(default_factory=SftOptim, description="AdamW and its schedule for fine-tuning.")
    lora: Lora = Field(default_factory=Lora, description="{enabled: true, quantize: nf4} trains adapters only on a 4-bit frozen base (QLoRA; merged into the saved weights).")
    init_from: str = init_from_field()


@asset(code_version="2", group_name="posttraining")
def sft_model(context: AssetExecutionContext, config: SftModelConfig, base_model: dict, instruction_data: dict,
              preference_data: dict, training_plan: dict, tokenizer: dict, storage: KilnStorageResource,
              torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """The base model fine-tuned on instruction pairs (loss on response tokens only, packed sequences, its own schedule) by a torchrun job; held-out measures before and after."""
    start, start_key, extra = start_weights("sft_model", config.init_from, base_model, training_plan, tokenizer, storage)
    fields = {**config.job_fields(), "train_files": [instruction_data["path"]], "val_files": [instruction_data["path"]],
              "eval_batches": 8, "ckpt_interval": config.max_steps, "keep_last": 1, "log_interval": 25,
              "init_from": start["checkpoint"]}
    plan = {**training_plan, "micro_batch": fields.pop("micro_batch"), "grad_accum": 1}  # a plan field, not a job one
    suite = heldout_suite(instruction_data, preference_data)
    spec = RunSpec("sft", fields, plan, {**(start_key or {"base_model": base_model["version"]}),
                                         "instruction_data": instruction_data["version"]}, tokenizer["path"])
    return align(context, spec, start, suite, storage, torchrun, mlflow, sft_report, extra)


def sft_report(result: dict[str, Any], rows: list[dict[str, Any]], out_dir) -> dict[str, Any]:
    """A fine-tuning run's page: the pretraining report of its curves and checkpoints, and the before/after table."""
    return {**pretrain_report(result, out_dir), "before_after": Table(comparison_table(rows))}


def align(context, spec: RunSpec, init: dict, suite: dict[str, list[dict]], storage: KilnStorageResource,
          torchrun: TorchrunResource, mlflow: MlflowResource, report: Callable[..., dict[str, Any]],
          extra: Union[dict[str, Any], Callable[[dict], dict[str, Any]], None] = None) -> Output[dict]:
    """Shared by sft_model, dpo_model and rl_model: measure ``init`` on the held-out suite, run the job (its folder
    keyed by its inputs, so a rerun resumes), measure the result; ``report`` adds the stage's own plots and tables,
    ``extra`` fields to the value (or a function of the job's result giving them). A reused run is returned as
    recorded, measures included: nothing is measured again."""
    device = spec.plan["hardware"]["device"]
    with torchrun.training_run(context, spec, storage, mlflow) as job:
        if job.reused is not None:
            return job.reused
        before = measure_before(init, suite, device)
        result = job.launch()
        after = measure_checkpoint(result["checkpoint"], suite, device)
        rows = log_comparison(before, after, job.run.tracking_uri, job.run.run_id, result["steps"])
        context.log.info(comparison_line(rows))
        fields = extra(result) if callable(extra) else extra
        return job.output(report_metadata(report(result, rows, job.out_dir), job.run), before=means(before),
                          after=means(after), after_scores=after, before_after=rows, suite_key=suite_key(suite),
                          **(fields or {}))


def feedback_field():
    return Field(default="checkable", description="The preference pairs it trains on: checkable (preference_data's, "
                 "each right answer known by construction), judged (judged_preferences' alone, labelled by the AI "
                 "judge; materialize it first) or mixed (both). Held-out measures are always on preference_data's "
                 "held-out pairs.")


class Feedback:
    """Which preference pairs a stage (dpo_model, reward_model) trains on, by its ``feedback`` config: the job's data
    files, the run-key inputs they add, and what the value and metadata say about them. Checkable (the default) adds
    nothing, so its runs keep the keys they had before there was a choice."""

    def __init__(self, stage: str, feedback: str, preference_data: dict, judged_preferences: Optional[dict]):
        with failing_on_config_errors():
            self.choice = check_feedback(feedback, f"{stage}.feedback")
        self.judged = judged_preferences if self.choice != "checkable" else None
        if self.choice != "checkable" and judged_preferences is None:
            raise Failure(description=f"{stage}.feedback is {feedback}, but judged_preferences was never materialized in "
                          f"this home: materialize it first, e.g. kiln run --preset rlhf --select "
                          f"judged_preferences,{stage} (or set {stage}.feedback to checkable)", allow_retries=False)
        self.files = feedback_files(self.choice, preference_data["path"], self.judged["path"] if self.judged else None)
        self.inputs = {"judged_preferences": self.judged["version"]} if self.judged else {}

    def record(self, result: dict) -> dict[str, Any]:
        """The value's ``feedback``: the choice, the training pairs from each source, the judged pairs' version."""
        pairs = result["pairs"]
        by_source = pairs_by_source(self.choice, pairs.get("train_by_file") or [pairs["train"]])
        return {"feedback": {"choice": self.choice, "pairs": by_source, "held_out_pairs": pairs["val"],
                             "judged_preferences": self.judged["version"] if self.judged else None}}

    def metadata(self, result: dict) -> dict[str, Any]:
        """Which pairs trained the stage, for the asset's page."""
        rec = self.record(result)["feedback"]
        return {"feedback": rec["choice"], "pairs_checkable": rec["pairs"]["checkable"],
                "pairs_judged": rec["pairs"]["judged"],
                **({"judged_preferences_version": rec["judged_preferences"]} if rec["judged_preferences"] else {})}

    def report(self, report: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        """``report`` (a stage's report of its result) followed by the feedback metadata."""
        return lambda result, *rest: {**report(result, *rest), **self.metadata(result)}


DPO_FIELDS = ("loss", *LOSS_FIELDS, "max_steps", "micro_batch", "eval_interval", "eval_pairs", "seed")


class DpoModelConfig(schema_of(DpoJob, include=DPO_FIELDS, name="DpoJobFields")):
    optim: DpoOptim = Field(default_factory=DpoOptim, description="AdamW and its schedule for DPO.")
    lora: Lora = Field(default_factory=Lora, description="{enabled: true, rank: 8} trains adapters only (merged into the saved weights).")
    init_from: str = init_from_field()
    feedback: str = feedback_field()


@asset(code_version="1", group_name="posttraining")
def dpo_model(context: AssetExecutionContext, config: DpoModelConfig, sft_model: dict, preference_data: dict,
              instruction_data: dict, training_plan: dict, tokenizer: dict, storage: KilnStorageResource,
              torchrun: TorchrunResource, mlflow: MlflowResource, judged_preferences: Optional[dict] = None) -> Output[dict]:
    """The SFT model trained on preference pairs (a torchrun job) by Direct Preference Optimization against itself frozen as the reference, or by another registered loss (IPO, SimPO without a reference, KTO), reporting reward margins and chosen/rejected log-probabilities; held-out measures before and after. The pairs are preference_data's, judged_preferences' (RLAIF) or both (feedback); held out are always preference_data's."""
    feedback = Feedback("dpo_model", config.feedback, preference_data, judged_preferences)  # None: never materialized
    start, start_key, extra = start_weights("dpo_model", config.init_from, sft_model, training_plan, tokenizer, storage)
    plan = {**training_plan, "micro_batch": config.micro_batch}
    fields = {**config.job_fields(), **feedback.files, "ckpt_interval": config.max_steps, "keep_last": 1, "log_interval": 25}
    del fields["init_from"], fields["feedback"]  # the job's start is RunSpec.init; its pairs are feedback.files
    suite = heldout_suite(instruction_data, preference_data)
    spec = RunSpec("dpo", fields, plan, {**(start_key or {"sft_model": sft_model["version"]}),
                                         "preference_data": preference_data["version"], **feedback.inputs},
                   tokenizer["path"], init=start["checkpoint"], reuse={"suite": suite_key(suite)})
    return align(context, spec, start, suite, storage, torchrun, mlflow, feedback.report(dpo_report),
                 lambda result: {**extra, **feedback.record(result)})


RL_FIELDS = ("reward", "max_steps", "max_new_tokens", "temperature", "partial_credit", "eval_interval", "eval_items",
             "seed", *RL_SETTINGS)


class RlModelConfig(schema_of(RlJob, include=RL_FIELDS, name="RlJobFields")):
    prompts_per_step: Annotated[int, Domain(1)] = Field(default=RlJob.micro_batch, description="Prompts per rank per step (the job's micro_batch).")
    optim: RlOptim = Field(default_factory=RlOptim, description="AdamW and its schedule for RL.")
    lora: Lora = Field(default_factory=Lora, description="{enabled: true} trains adapters only.")
    init_from: str = init_from_field()


@asset(code_version="2", group_name="posttraining")
def rl_model(context: AssetExecutionContext, config: RlModelConfig, dpo_model: dict, instruction_data: dict,
             preference_data: dict, training_plan: dict, tokenizer: dict, storage: KilnStorageResource,
             torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """The DPO model trained by reinforcement learning on checkable arithmetic (GRPO-style group-relative advantages, KL penalty to the DPO model, DPO's loss replayed on preference pairs so the preferences DPO taught hold) by a torchrun job; reward over steps, held-out measures before and after."""
    start, start_key, extra = start_weights("rl_model", config.init_from, dpo_model, training_plan, tokenizer, storage)
    fields = {**config.job_fields(), "train_files": [instruction_data["path"]], "ckpt_interval": config.max_steps,
              "keep_last": 1, "log_interval": 10}
    fields["micro_batch"] = fields.pop("prompts_per_step")
    del fields["init_from"]  # the job's start is RunSpec.init
    if config.preference_coef:
        fields["preference_file"] = preference_data["path"]
    plan = {**training_plan, "micro_batch": config.prompts_per_step}
    suite = heldout_suite(instruction_data, preference_data)
    spec = RunSpec("rl", fields, plan, {**(start_key or {"dpo_model": dpo_model["version"]}),
                                        "instruction_data": instruction_data["version"]},
                   tokenizer["path"], init=start["checkpoint"], reuse={"suite": suite_key(suite)})
    return align(context, spec, start, suite, storage, torchrun, mlflow, rl_report, extra)
