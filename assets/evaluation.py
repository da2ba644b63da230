"""Step 8 as an asset: validation loss, bits per byte and the offline lm-eval suite for the base model."""


import math

from dagster import AssetExecutionContext, Config, MetadataValue, Output, asset
from pydantic import Field

from assets._common import commit_output, data_version, md_table, mlflow_meta
from assets.collect import corpus_texts
from kiln.checkpoint import load_for_inference
from kiln.evaluation.suite import run_suite, sample_generations
from kiln.evaluation.tasks import build_tasks
from kiln.shards import split_of
from kiln.storage import atomic_write_json, stable_hash, staging_dir
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

PROMPTS = ["The", "In this chapter, we", "A shell script is", "What is 12 + 7?"]


class EvalScoresConfig(Config):
    tasks: list[str] = Field(default_factory=lambda: ["kiln_heldout_ppl", "kiln_continuation", "kiln_lastword"],
                             description="lm-eval task names: Kiln's local tasks, or standard ones cached locally.")
    n_items: int = Field(default=200, description="Items per local task, built from held-out documents.")
    limit: int | None = Field(default=None, description="Evaluate at most this many items per task (None: all).")
    batch_size: int = Field(default=16, description="Requests per forward pass.")
    max_new_tokens: int = Field(default=40, description="Tokens generated per sample prompt.")
    seed: int = Field(default=1234, description="Seed for task building and sampling.")


def held_out_documents(clean_corpus: dict, val_permille: int, limit: int = 5000) -> list[str]:
    docs = []
    for doc_id, text in corpus_texts(clean_corpus["path"]):
        if split_of(doc_id, val_permille) == "val":
            docs.append(text)
            if len(docs) >= limit:
                break
    return docs


@asset(code_version="1", group_name="evaluation")
def eval_scores(context: AssetExecutionContext, config: EvalScoresConfig, base_model: dict, clean_corpus: dict,
                token_shards: dict, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Held-out loss and bits per byte, and lm-eval tasks built from held-out documents (scored through Kiln's native adapter), each beside its chance baseline."""
    docs = held_out_documents(clean_corpus, token_shards["val_permille"])
    model, enc, meta = load_for_inference(base_model["checkpoint"])
    with mlflow.asset_run(context, params=config.model_dump(), tags={"input.base_model": base_model["version"],
                                                                      "training_run": base_model["mlflow_run_id"]}) as run, \
            staging_dir(storage.path("eval_scores")) as stage:
        tasks_dir = storage.path("eval_tasks", stable_hash([clean_corpus["version"], config.n_items, config.seed])[:16])
        built = build_tasks(docs, tasks_dir, config.n_items, config.seed)
        context.log.info(f"evaluating {config.tasks} on checkpoint {meta['path']}")
        scores = run_suite(model, enc, tasks_dir, config.tasks, limit=config.limit, batch_size=config.batch_size)
        val_loss = base_model["final_val_loss"]
        sample = "".join(docs[:200])
        tokens_per_byte = len(enc.encode_ordinary(sample)) / max(len(sample.encode()), 1)
        bpb = val_loss / math.log(2) * tokens_per_byte
        gens = sample_generations(model, enc, PROMPTS, config.max_new_tokens, config.seed)
        result = {"checkpoint": meta["path"], "step": meta["step"], "val_loss": val_loss, "val_bits_per_byte": bpb,
                  "uniform_loss": math.log(enc.n_vocab), "tasks": scores, "task_items": built, "generations": gens}
        atomic_write_json(stage / "scores.json", result)
        final, version = commit_output(stage, storage.path("eval_scores"))
        flat = {f"{t}.{m}": v for t, row in scores.items() for m, v in row.items() if isinstance(v, (int, float)) and m != "items"}
        run.log_metrics({"val_loss": val_loss, "val_bits_per_byte": bpb, **flat}, step=meta["step"])
        rows = [{"task": t, **{m: v for m, v in row.items() if not m.endswith("stderr")}} for t, row in scores.items()]
        return Output({**result, "path": str(final / "scores.json"), "version": version},
                      data_version=data_version(version), metadata={
            "val_loss": val_loss, "val_bits_per_byte": round(bpb, 4), "uniform_guess_loss": round(math.log(enc.n_vocab), 4),
            "scores": md_table(rows), "samples": md_table(gens), "checkpoint": MetadataValue.path(meta["path"]),
            "path": MetadataValue.path(str(final / "scores.json")), **mlflow_meta(run),
        })
