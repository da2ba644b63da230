"""The model card (README.md of a release bundle), written from the outputs of the assets that made the model.

``model_card("kiln-demo", "Apache-2.0", upstream, stages)``: upstream is {asset name: its output}, as release_bundle has them.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any, Mapping

from kiln.posttrain.measures import MEASURES


def table(rows: list[dict]) -> str:
    """A markdown table (columns from the first row), or ``_none_``; floats to 4 significant digits."""
    if not rows:
        return "_none_\n"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]) + "\n"


def _model(name: str, license: str, plan: dict, tok: dict) -> str:
    m = plan["model"]
    return f"""# {name}

A GPT-2-style language model trained with Kiln from public text. Released {dt.date.today().isoformat()} under {license}.

## Model
{plan['params']:,} parameters; {m['n_layer']} layers, {m['n_head']} heads, width {m['n_embd']},
context {m['block_size']} tokens, vocabulary {m['vocab_size']} ({tok['kind']} tokenizer, {tok['n_vocab']} tokens,
{tok['bytes_per_token']:.2f} bytes/token on held-out text). Weights: `model.safetensors` in the Hugging Face GPT-2 layout.

"""


def _data(raw: dict, clean: dict, tok: dict, shards: dict) -> str:
    src_rows = [{"source": n, "package": s["package"] or "local", "version": s["version"] or "",
                 "sha256": (s["sha256"] or "")[:16], "documents": s["documents"], "licence": s["license"]}
                for n, s in raw["stats"]["sources"].items()]
    rep = clean["report"]
    drop_rows = [{"reason": r, "documents": v["docs"], "MB": v["bytes"] / 1e6} for r, v in rep["reasons"].items()]
    return f"""## Training data (lineage)
Raw documents version `{raw['version']}`: {raw['stats']['totals']['documents']:,} documents.

{table(src_rows)}
Clean corpus version `{clean['version']}`: kept {rep['kept_docs']:,} of {rep['input_docs']:,} documents
({rep['kept_bytes'] / 1e6:.2f} MB); dedup rate {rep['dedup_rate']:.1%}. Filter settings:
`{json.dumps(rep['config'], sort_keys=True)}`

Removed, by reason:

{table(drop_rows)}
Token shards version `{shards['version']}`: {shards['totals']['train']['tokens']:,} train tokens,
{shards['totals']['val']['tokens']:,} validation tokens (fixed split, {shards['val_permille']}/1000 documents by id hash).
Tokenizer version `{tok['version']}`.

"""


def _training(plan: dict, base: dict, tok: dict) -> str:
    return f"""## Training
{plan['parallelism']} on {plan['world_size']} x {plan['hardware']['device']}; {base['steps']} steps of {plan['tokens_per_step']:,} tokens
({base['tokens']:,} tokens, {plan['tokens_per_param']:.2f} tokens/parameter); micro-batch {plan['micro_batch']} x accumulation {plan['grad_accum']}.
Validation loss {base['initial_val_loss']:.4f} -> {base['final_val_loss']:.4f} nats/token (a uniform guess scores {math.log(tok['n_vocab']):.4f}).
Base checkpoint `{base['version']}` (MLflow run `{base['mlflow_run_id']}`).

"""


def _evaluation(scores: dict) -> str:
    task_rows = [{"task": t, **{m: v for m, v in row.items() if not m.endswith("stderr")}} for t, row in scores["tasks"].items()]
    return f"""## Evaluation
Validation bits per byte {scores['val_bits_per_byte']:.4f}. Tasks built from held-out documents, scored with lm-eval through Kiln's adapter:

{table(task_rows)}
"""


def _post_training(instr: dict, prefs: dict, sft: dict, dpo: dict, rl: dict, stages: list[dict]) -> str:
    decon = instr["decontamination"]
    lora = " Adapters (LoRA) were trained and merged into these weights." if (dpo["lora"]["enabled"] or rl["lora"]["enabled"]) else ""
    return f"""## Post-training
Three stages, each a torchrun job starting from the previous stage's weights; these weights are the last stage's.

1. Supervised fine-tuning ({sft['steps']} steps) on instruction data version `{instr['version']}`
   ({json.dumps(instr['counts'])}), loss on response tokens only. Pairs sharing a {decon['ngram_words']}-word run
   with an evaluation item were removed ({decon['pairs_sharing_eval_ngrams']}), and held-out pages were not used.
2. Direct Preference Optimization ({dpo['steps']} steps, beta {dpo['beta']}) on preference data version `{prefs['version']}`
   ({json.dumps(prefs['counts'])}: the correct response chosen, a wrong one rejected), against the SFT model as reference.
3. Reinforcement learning ({rl['steps']} steps, GRPO-style, {rl['group_size']} answers per prompt, KL weight {rl['kl_coef']} to the
   DPO model) on {rl['reward']} prompts whose answers are checked exactly (a near miss earns {rl['partial_credit']} x its
   closeness); held-out greedy exact-answer rate {rl['initial_val_reward']:.3f} -> {rl['final_val_reward']:.3f}.
{lora}
Held-out measures after each stage, on the same items throughout:

{table(stages)}
{chr(10).join(f"- `{m}`: {what}" for m, what in MEASURES.items())}

"""


def _limits(raw: dict) -> str:
    return f"""## Limits
A small model trained for minutes on a few megabytes of documentation and web text: it produces fluent-looking but
unreliable text, knows little, and must not be used for decisions. Evaluation items come from held-out documents of
the same corpus, so scores measure in-distribution modelling, not general ability.

## Data licences
{', '.join(sorted({s['license'] for s in raw['stats']['sources'].values()}))}. The weights are derived from data under these licences.
"""


TRAINING_STAGES = (("base", "base_model"), ("sft", "sft_model"), ("dpo", "dpo_model"), ("rl", "rl_model"))


def logbook_summary(up: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per training stage from its logbook (kiln.train.logbook): attempts, how they ended, steps lost,
    spikes, skipped batches; then its ledger (kiln.train.ledger): device-hours, energy and cost. A stage whose
    output was recorded before logbooks existed is left out."""
    from kiln.train.logbook import OUTCOMES, summary

    rows = []
    for stage, asset in TRAINING_STAGES:
        out = up.get(asset) or {}
        if "logbook" not in out:
            continue
        s, led = summary(out["logbook"]), out.get("ledger") or {}
        rows.append({"stage": stage, "attempts": s["attempts"],
                     "ended": ", ".join(f"{s[o]} {o.replace('_', ' ')}" for o in OUTCOMES if s[o]),
                     "steps lost": s["steps_lost"], "spikes": s["spikes"], "skipped batches": s["skipped_batches"],
                     "device-hours": led.get("device_hours", 0.0), "energy kWh": led.get("energy_kwh", 0.0),
                     f"cost {led.get('currency', '')}".strip(): led.get("cost", 0.0),
                     "energy basis": led.get("energy_basis", "")})
    return rows


def _operations(up: Mapping[str, dict[str, Any]]) -> str:
    """The card's record of how training went (every attempt) and what it cost, for the whole chain."""
    rows = logbook_summary(up)
    if not rows:
        return ""
    cost_key = next(k for k in rows[0] if k.startswith("cost"))
    total = {k: sum(r[k] for r in rows) for k in ("device-hours", "energy kWh", cost_key)}
    led = (up.get("base_model") or {}).get("ledger") or {}
    planned = (f" The plan estimated {led['planned_device_hours']:.4g} device-hours ({led['planned_energy_kwh']:.4g} kWh, "
               f"{led['planned_cost']:.4g} {led['currency']}) for the base model." if "planned_device_hours" in led else "")
    estimated = any("estimate" in r["energy basis"] for r in rows)
    return f"""## Training operations, cost and energy
Every attempt of every training stage is in its run logbook (`kiln logbook <this folder>`): how each ended, steps lost,
loss spikes and the batches skipped after them. Device-hours count each attempt's wall time on all its devices
(work redone after a failure included); money is at {led.get('price_per_device_hour', 0):g} {led.get('currency', '')} per device-hour.

{table(rows)}
Whole chain: {total['device-hours']:.4g} device-hours, {total['energy kWh']:.4g} kWh{' (partly or wholly estimated)' if estimated else ' (measured)'}, {total[cost_key]:.4g} {led.get('currency', '')}.{planned}

"""


def model_card(name: str, license: str, up: Mapping[str, dict[str, Any]], stages: list[dict]) -> str:
    """README.md of a release: model, training data lineage, training, evaluation, post-training, limits, licences.

    up: the outputs of raw_documents, clean_corpus, tokenizer, token_shards, training_plan, base_model, eval_scores,
    instruction_data, preference_data, sft_model, dpo_model and rl_model; stages: one row per held-out measure with
    a column per model (base, sft, dpo, rl).
    """
    return "".join([
        _model(name, license, up["training_plan"], up["tokenizer"]),
        _data(up["raw_documents"], up["clean_corpus"], up["tokenizer"], up["token_shards"]),
        _training(up["training_plan"], up["base_model"], up["tokenizer"]),
        _evaluation(up["eval_scores"]),
        _post_training(up["instruction_data"], up["preference_data"], up["sft_model"], up["dpo_model"], up["rl_model"], stages),
        _operations(up),
        _limits(up["raw_documents"]),
    ])
