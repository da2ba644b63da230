"""Step 10 as an asset: the release bundle (safetensors, config, tokenizer, model card from lineage, checksums)."""


import datetime as dt
import json
import math

from dagster import AssetCheckResult, AssetExecutionContext, Config, MetadataValue, Output, asset, asset_check
from pydantic import Field

from assets._common import commit_output, md_table, mlflow_meta
from kiln.posttrain.measures import MEASURES, stage_rows
from kiln.release.registry import compare_scores, flat_scores, previous_release, register_release
from kiln.release.bundle import write_release
from kiln.common.files import staging_dir
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource


class ReleaseBundleConfig(Config):
    name: str = Field(default="kiln-demo", description="Model name used in the card and bundle.")
    license: str = Field(default="Apache-2.0", description="Licence of the released weights (the data's licences are listed separately).")
    alias: str = Field(default="candidate", description="MLflow registry alias moved to this release unless evaluation regressed.")
    regression_tolerance: float = Field(default=0.02, description="How much worse (absolute) any eval score may be than the previous release's.")


def _table(rows: list[dict]) -> str:
    if not rows:
        return "_none_\n"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]) + "\n"


def model_card(name: str, license: str, raw: dict, clean: dict, tok: dict, shards: dict, plan: dict, base: dict,
               scores: dict, instr: dict, prefs: dict, sft: dict, dpo: dict, rl: dict) -> str:
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
Three stages, each a torchrun job starting from the previous stage's weights; these weights are the last stage's.

1. Supervised fine-tuning ({sft['steps']} steps) on instruction data version `{instr['version']}`
   ({json.dumps(instr['counts'])}), loss on response tokens only. Pairs sharing a {instr['decontamination']['ngram_words']}-word run
   with an evaluation item were removed ({instr['decontamination']['pairs_sharing_eval_ngrams']}), and held-out pages were not used.
2. Direct Preference Optimization ({dpo['steps']} steps, beta {dpo['beta']}) on preference data version `{prefs['version']}`
   ({json.dumps(prefs['counts'])}: the correct response chosen, a wrong one rejected), against the SFT model as reference.
3. Reinforcement learning ({rl['steps']} steps, GRPO-style, {rl['group_size']} answers per prompt, KL weight {rl['kl_coef']} to the
   DPO model) on {rl['reward']} prompts whose answers are checked exactly (a near miss earns {rl['partial_credit']} x its
   closeness); held-out greedy exact-answer rate {rl['initial_val_reward']:.3f} -> {rl['final_val_reward']:.3f}.
{' Adapters (LoRA) were trained and merged into these weights.' if (dpo['lora']['enabled'] or rl['lora']['enabled']) else ''}
Held-out measures after each stage, on the same items throughout:

{_table(stage_rows(sft, dpo, rl))}
{chr(10).join(f"- `{m}`: {what}" for m, what in MEASURES.items())}

## Limits
A small model trained for minutes on a few megabytes of documentation and web text: it produces fluent-looking but
unreliable text, knows little, and must not be used for decisions. Evaluation items come from held-out documents of
the same corpus, so scores measure in-distribution modelling, not general ability.

## Data licences
{', '.join(sorted({s['license'] for s in raw['stats']['sources'].values()}))}. The weights are derived from data under these licences.
"""


@asset(code_version="1", group_name="release")
def release_bundle(context: AssetExecutionContext, config: ReleaseBundleConfig, rl_model: dict, dpo_model: dict,
                   sft_model: dict, preference_data: dict, base_model: dict,
                   eval_scores: dict, training_plan: dict, token_shards: dict, tokenizer: dict, clean_corpus: dict,
                   raw_documents: dict, instruction_data: dict, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """The released model, the last post-training stage (SFT -> DPO -> RL): safetensors weights in the Hugging Face GPT-2 layout, config, tokenizer, a model card written from lineage, and SHA256SUMS."""
    card = model_card(config.name, config.license, raw_documents, clean_corpus, tokenizer, token_shards, training_plan,
                      base_model, eval_scores, instruction_data, preference_data, sft_model, dpo_model, rl_model)
    lineage = {k: v["version"] for k, v in {"raw_documents": raw_documents, "clean_corpus": clean_corpus, "tokenizer": tokenizer,
                                              "token_shards": token_shards, "base_model": base_model, "eval_scores": eval_scores,
                                              "instruction_data": instruction_data, "preference_data": preference_data,
                                              "sft_model": sft_model, "dpo_model": dpo_model, "rl_model": rl_model}.items()}
    with mlflow.asset_run(context, params={"name": config.name}, tags={f"input.{k}": v for k, v in lineage.items()},
                          reuse={"config": config.model_dump(), "lineage": lineage}) as run, \
            staging_dir(storage.path("release_bundle")) as stage:
        if run.reused is not None:
            return run.reused
        runs = {k: v["mlflow_run_id"] for k, v in {"base_model": base_model, "sft_model": sft_model, "dpo_model": dpo_model,
                                                   "rl_model": rl_model}.items()}
        scores = flat_scores(eval_scores)
        rep = clean_corpus["report"]
        stage_of = lambda o: {k: o[k] for k in ("version", "steps", "tokens", "initial_val_loss", "final_val_loss",  # noqa: E731
                                                "wall_s", "checkpoint") if k in o}
        extra = {
            "name": config.name, "lineage": lineage, "mlflow_runs": runs, "license": config.license,
            "sources": [{**s, "documents": raw_documents["stats"]["sources"].get(s["name"], {}).get("documents")}
                        for s in raw_documents["sources"]],
            "filters": rep["config"],
            "corpus": {**{k: rep[k] for k in ("input_docs", "kept_docs", "kept_bytes", "dedup_rate")},
                       "removed": {r: v["docs"] for r, v in rep["reasons"].items()}},
            "tokens": {s: token_shards["totals"][s]["tokens"] for s in ("train", "val")},
            "plan": {k: training_plan[k] for k in ("params", "parallelism", "world_size", "micro_batch", "grad_accum",
                                                   "tokens_per_step", "model", "hardware") if k in training_plan},
            "training": {"base_model": stage_of(base_model)},
            "eval": {**scores, "uniform_loss": eval_scores["uniform_loss"]},
            "post_training": [{"stage": n, **stage_of(o)} for n, o in (("sft", sft_model), ("dpo", dpo_model), ("rl", rl_model))],
            "configs": {"release_bundle": config.model_dump()},
        }
        manifest = write_release(rl_model["checkpoint"], stage, card, extra)
        final, version = commit_output(stage, storage.path("release_bundle"))
        run.log_artifact(final / "README.md")
        uri = mlflow.resolved_uri()
        prev = previous_release(uri, config.name, config.alias)
        regressions = [str(r) for r in compare_scores(scores, prev.scores, config.regression_tolerance)] if prev else []
        reg = register_release(uri, config.name, final, scores=scores, lineage=lineage, run_id=run.run_id,
                               alias=config.alias, set_alias=not regressions)
        if regressions:
            context.log.warning(f"evaluation regressed against {config.name} version {prev.version}: {regressions}; "
                                f"registered version {reg.version} without moving alias '{config.alias}'")
        rows = [{"file": n, "sha256": h[:16], "bytes": (final / n).stat().st_size} for n, h in manifest["files"].items()]
        registry = {"name": config.name, "version": reg.version, "alias": config.alias if not regressions else None,
                    "previous": prev.version if prev else None}
        return run.output({"dir": str(final), "version": version, "lineage": lineage, "files": manifest["files"],
                           "registry": registry, "scores": scores, "regressions": regressions}, version, {
            "bundle": MetadataValue.path(str(final)), "files": md_table(rows), "bytes": manifest["bytes"],
            "registered_version": MetadataValue.url(f"{mlflow.ui_url.rstrip('/')}/#/models/{config.name}/versions/{reg.version}"),
            "previous_version": str(registry["previous"]), "regressions": MetadataValue.json(regressions),
            "model_card": MetadataValue.md(card), "lineage": MetadataValue.json(lineage), **mlflow_meta(run),
        })


@asset_check(asset=release_bundle, blocking=True, description=(
    "Fails when any evaluation score is worse than the previous release's (beyond release_bundle.regression_tolerance); "
    "the registry alias then stays on the previous release."))
def release_no_regression(release_bundle: dict) -> AssetCheckResult:
    regressions = release_bundle.get("regressions", [])
    return AssetCheckResult(passed=not regressions, description="; ".join(regressions) or None, metadata={
        "registered_version": str(release_bundle["registry"]["version"]),
        "previous_version": str(release_bundle["registry"]["previous"]),
        "regressions": MetadataValue.json(regressions)})
