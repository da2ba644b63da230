"""Step 10 as an asset: the release bundle (safetensors, config, tokenizer, model card from lineage, checksums)."""


import datetime as dt
import json
import math

from dagster import AssetExecutionContext, Config, MetadataValue, Output, asset
from pydantic import Field

from assets._common import commit_output, data_version, md_table, mlflow_meta
from kiln.release import write_release
from kiln.storage import staging_dir
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource


class ReleaseBundleConfig(Config):
    name: str = Field(default="kiln-demo", description="Model name used in the card and bundle.")
    license: str = Field(default="Apache-2.0", description="Licence of the released weights (the data's licences are listed separately).")


def _table(rows: list[dict]) -> str:
    if not rows:
        return "_none_\n"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]) + "\n"


def model_card(name: str, license: str, raw: dict, clean: dict, tok: dict, shards: dict, plan: dict, base: dict,
               scores: dict, sft: dict, instr: dict) -> str:
    src_rows = [{"source": n, "package": s["package"] or "local", "version": s["version"] or "",
                 "sha256": (s["sha256"] or "")[:16], "documents": s["documents"], "licence": s["license"]}
                for n, s in raw["stats"]["sources"].items()]
    rep = clean["report"]
    drop_rows = [{"reason": r, "documents": v["docs"], "MB": v["bytes"] / 1e6} for r, v in rep["reasons"].items()]
    task_rows = [{"task": t, **{m: v for m, v in row.items() if not m.endswith("stderr")}} for t, row in scores["tasks"].items()]
    return f"""# {name}

A GPT-2-style language model trained with Kiln from public text. Released {dt.date.today().isoformat()} under {license}.

## Model
{plan['params']:,} parameters; {plan['model']['n_layer']} layers, {plan['model']['n_head']} heads, width {plan['model']['n_embd']},
context {plan['model']['block_size']} tokens, vocabulary {plan['model']['vocab_size']} ({tok['kind']} tokenizer, {tok['n_vocab']} tokens,
{tok['bytes_per_token']:.2f} bytes/token on held-out text). Weights: `model.safetensors` in the Hugging Face GPT-2 layout.

## Training data (lineage)
Raw documents version `{raw['version']}`: {raw['stats']['totals']['documents']:,} documents.

{_table(src_rows)}
Clean corpus version `{clean['version']}`: kept {rep['kept_docs']:,} of {rep['input_docs']:,} documents
({rep['kept_bytes'] / 1e6:.2f} MB); dedup rate {rep['dedup_rate']:.1%}. Filter settings:
`{json.dumps(rep['config'], sort_keys=True)}`

Removed, by reason:

{_table(drop_rows)}
Token shards version `{shards['version']}`: {shards['totals']['train']['tokens']:,} train tokens,
{shards['totals']['val']['tokens']:,} validation tokens (fixed split, {shards['val_permille']}/1000 documents by id hash).
Tokenizer version `{tok['version']}`.

## Training
{plan['parallelism']} on {plan['world_size']} x {plan['hardware']['device']}; {base['steps']} steps of {plan['tokens_per_step']:,} tokens
({base['tokens']:,} tokens, {plan['tokens_per_param']:.2f} tokens/parameter); micro-batch {plan['micro_batch']} x accumulation {plan['grad_accum']}.
Validation loss {base['initial_val_loss']:.4f} -> {base['final_val_loss']:.4f} nats/token (a uniform guess scores {math.log(tok['n_vocab']):.4f}).
Base checkpoint `{base['version']}` (MLflow run `{base['mlflow_run_id']}`).

## Evaluation
Validation bits per byte {scores['val_bits_per_byte']:.4f}. Tasks built from held-out documents, scored with lm-eval through Kiln's adapter:

{_table(task_rows)}
## Post-training
Supervised fine-tuning on instruction data version `{instr['version']}` ({json.dumps(instr['counts'])}), loss on responses only.

{_table(sft['before_after'])}
## Limits
A small model trained for minutes on a few megabytes of documentation and web text: it produces fluent-looking but
unreliable text, knows little, and must not be used for decisions. Evaluation items come from held-out documents of
the same corpus, so scores measure in-distribution modelling, not general ability.

## Data licences
{', '.join(sorted({s['license'] for s in raw['stats']['sources'].values()}))}. The weights are derived from data under these licences.
"""


@asset(code_version="1", group_name="release")
def release_bundle(context: AssetExecutionContext, config: ReleaseBundleConfig, sft_model: dict, base_model: dict,
                   eval_scores: dict, training_plan: dict, token_shards: dict, tokenizer: dict, clean_corpus: dict,
                   raw_documents: dict, instruction_data: dict, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """The released model: safetensors weights in the Hugging Face GPT-2 layout, config, tokenizer, a model card written from lineage, and SHA256SUMS."""
    card = model_card(config.name, config.license, raw_documents, clean_corpus, tokenizer, token_shards, training_plan,
                      base_model, eval_scores, sft_model, instruction_data)
    lineage = {k: v["version"] for k, v in {"raw_documents": raw_documents, "clean_corpus": clean_corpus, "tokenizer": tokenizer,
                                              "token_shards": token_shards, "base_model": base_model, "eval_scores": eval_scores,
                                              "instruction_data": instruction_data, "sft_model": sft_model}.items()}
    with mlflow.asset_run(context, params={"name": config.name}, tags={f"input.{k}": v for k, v in lineage.items()}) as run, \
            staging_dir(storage.path("release_bundle")) as stage:
        manifest = write_release(sft_model["checkpoint"], stage, card, {"name": config.name, "lineage": lineage,
                                                                         "mlflow_runs": {"base_model": base_model["mlflow_run_id"], "sft_model": sft_model["mlflow_run_id"]}})
        final, version = commit_output(stage, storage.path("release_bundle"))
        run.log_artifact(final / "README.md")
        rows = [{"file": n, "sha256": h[:16], "bytes": (final / n).stat().st_size} for n, h in manifest["files"].items()]
        return Output({"dir": str(final), "version": version, "lineage": lineage, "files": manifest["files"]},
                      data_version=data_version(version), metadata={
            "bundle": MetadataValue.path(str(final)), "files": md_table(rows), "bytes": manifest["bytes"],
            "model_card": MetadataValue.md(card), "lineage": MetadataValue.json(lineage), **mlflow_meta(run),
        })
