"""The model card (README.md of a release bundle), written from the outputs of the assets that made the model.

``model_card("kiln-demo", "Apache-2.0", upstream, stages, settings, figures)``: upstream is {asset name: its output},
as release_bundle has them, which ``card_inputs`` reads once into typed records (kiln.release.records) for the
sections to read; ``card_figures(upstream)`` renders the PNGs the card shows (the loss curve, scores by
checkpoint), which the bundle holds beside the card with the run's whole config (CONFIG_FILE).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kiln.common.plots import line_plot_png
from kiln.model.config import ModelConfig
from kiln.model.families import family
from kiln.posttrain.measures import MEASURES, NOISE_Z, change_rows, worse_beyond_noise
from kiln.release.records import (BaseRun, CardPlan, CleanCorpus, DpoRun, EvalScores, Feedback, InstructionData,
                                  JudgedPreferences, LadderPrediction, LossHistory, PpoRun, PreferenceData, RawDocuments,
                                  RedTeam, RewardRun, RlRun, SftRun, StartingWeights, TokenizerInfo, TokenShards,
                                  feedback_of, prediction_of)

CONFIG_FILE = "run_config.yaml"  # every asset's config in the run that made the release, defaults included
LOSS_PLOT, CHECKPOINT_PLOT, LADDER_PLOT = "loss_curve.png", "scores_by_checkpoint.png", "scaling_ladder.png"


def task_score(task: str, row: dict[str, Any] | None) -> dict[str, Any] | None:
    """{metric, value, stderr, chance} of a task's primary metric (kiln.evaluation.registry) in one row of scores;
    None when the row holds no number for it (e.g. a clean copy with no items left)."""
    from kiln.evaluation.registry import REGISTRY

    metric = REGISTRY.primary(task, row) if row else None
    if metric is None:
        return None
    stderr = row.get(f"{metric}_stderr")
    return {"metric": metric, "value": row[metric], "stderr": stderr if isinstance(stderr, (int, float)) else None,
            "chance": row.get("chance", REGISTRY.chance(task))}


def table(rows: list[dict]) -> str:
    """A markdown table (columns from the first row), or ``_none_``; floats to 4 significant digits."""
    if not rows:
        return "_none_\n"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]) + "\n"


# What each releasable stage's weights are, in words (release_bundle.stage).
RELEASED_WORDS = {"rl_model": "the RL stage's: the base model after SFT, then DPO, then RL",
                  "ppo_model": "the PPO stage's: the base model after SFT, then PPO against a reward model (not the DPO "
                               "-> RL chain, which the card shows for comparison)"}


def _model(name: str, license: str, plan: CardPlan, tok: TokenizerInfo, released: str = "rl_model") -> str:
    m = plan.model
    desc = family(m.get("family", "gpt2"))  # GPT-2 plans omit the family (kiln.model.config.model_dict)
    style = f"A {desc.adapter.style}"
    heads = f"{m['n_head']} heads" + (f" ({m['n_kv_head']} key/value)" if "n_kv_head" in m else "")
    layout = desc.adapter.hf_config(ModelConfig(**m), 0)["architectures"][0]
    return f"""# {name}

{style} language model trained with Kiln from public text. Released {dt.date.today().isoformat()} under {license}.

## Model
{plan.params:,} parameters; {m['n_layer']} layers, {heads}, width {m['n_embd']},
context {m['block_size']} tokens, vocabulary {m['vocab_size']} ({tok.kind} tokenizer, {tok.n_vocab} tokens,
{tok.bytes_per_token:.2f} bytes/token on held-out text). Weights: `model.safetensors` in the Hugging Face {layout} layout;
they are {RELEASED_WORDS[released]}.

"""


def _pretrained(starts: list[tuple[str, StartingWeights]]) -> str:
    """Where the weights started, when a stage started from released weights (kiln.pretrained); else nothing.
    starts: (the stage's training in words, the weights it started from), in training order."""
    if not starts:
        return ""
    lines = [f"- {what} started from `{p.source}`: {p.model_type} weights, licence {p.license}, "
             f"folder content sha256 `{p.sha256}` (imported as version `{p.version}`, safetensors only)"
             for what, p in starts]
    first = starts[0][1]
    added = ", ".join(f"`{t}` = {i}" for t, i in sorted((first.added_tokens or {}).items(), key=lambda kv: kv[1]))
    return f"""## Starting weights
Not trained from scratch: these weights continue released ones.

{chr(10).join(lines)}

The imported tokenizer is kept with every id unchanged ({first.imported_vocab} tokens); the chat tokens it lacked
were appended ({added or "none"}), each embedding row starting as the mean of the imported rows. The starting weights' licence
({', '.join(sorted({p.license for _, p in starts}))}) applies to these weights as well as the one below.

"""


def _data(raw: RawDocuments, clean: CleanCorpus, tok: TokenizerInfo, shards: TokenShards) -> str:
    src_rows = [{"source": s.name, "package": s.package or "local", "version": s.version or "",
                 "sha256": (s.sha256 or "")[:16], "documents": s.documents, "licence": s.license}
                for s in raw.sources]
    drop_rows = [{"reason": r, "documents": v["docs"], "MB": f"{v['bytes'] / 1e6:.3f}"} for r, v in clean.reasons.items()]
    return f"""## Training data (lineage)
Raw documents version `{raw.version}`: {raw.documents:,} documents.

{table(src_rows)}
Clean corpus version `{clean.version}`: kept {clean.kept_docs:,} of {clean.input_docs:,} documents
({clean.kept_bytes / 1e6:.2f} MB); dedup rate {clean.dedup_rate:.1%}. The filter settings that differ from the defaults
are listed under Settings below; all of them are `filters` in `kiln.json`.

Removed, by reason:

{table(drop_rows)}
Token shards version `{shards.version}`: {shards.train_tokens:,} train tokens,
{shards.val_tokens:,} validation tokens (fixed split, {shards.val_permille}/1000 documents by id hash).
Tokenizer version `{tok.version}`.

"""


def _hardware(plan: CardPlan) -> str:
    """``1 CPU process`` / ``8 CUDA devices with DDP (data parallel)`` / ``16 CUDA devices on 2 nodes, sharded with FSDP2``."""
    hw, n = plan.hardware, plan.world_size
    if hw["device"] == "cpu":
        where = f"{n} CPU process{'es' if n > 1 else ''}"
    else:
        where = f"{n} {hw['device'].upper()} device{'s' if n > 1 else ''}"
    if hw.get("nnodes", 1) > 1:
        where += f" on {hw['nnodes']} nodes,"
    how = {"none": "", "ddp": " with DDP (data parallel)", "fsdp": " sharded with FSDP2"}
    return where + how.get(plan.parallelism, f" ({plan.parallelism})")


def _training(plan: CardPlan, base: BaseRun, tok: TokenizerInfo, figures: Mapping[str, bytes]) -> str:
    curve = f"\n![Training and validation loss by step]({LOSS_PLOT})\n" if LOSS_PLOT in figures else ""
    return f"""## Training
Trained on {_hardware(plan)}: {base.steps} steps of {plan.tokens_per_step:,} tokens ({base.tokens:,} tokens,
{plan.tokens_per_param:.2f} tokens per parameter); micro-batch {plan.micro_batch} x gradient accumulation {plan.grad_accum}.
Validation loss fell from {base.initial_val_loss:.4f} to {base.final_val_loss:.4f} nats/token (guessing uniformly over
the vocabulary scores {math.log(tok.n_vocab):.4f}). Base model version `{base.version}`: checkpoint
`{checkpoint_name(base.checkpoint)}` in the Kiln home's storage, MLflow run `{base.mlflow_run_id}`.
{curve}
"""


def _scaling(plan: CardPlan, final_val_loss: float, figures: Mapping[str, bytes]) -> str:
    """The scaling ladder behind the plan (when one was fitted): its runs, the fitted law beside Chinchilla's, and
    the law's prediction of this model's final validation loss against the measured one."""
    sc = plan.scaling
    if not sc:
        return ""
    from kiln.scaling.law import CHINCHILLA

    iv = sc.intervals or {}
    law_rows = [{"coefficient": k, "fitted": f"{sc.law[k]:.4g}",
                 "95% bootstrap interval": (f"{iv[k][0]:.4g} .. {iv[k][1]:.4g}" if iv.get(k) else "-"),
                 "Chinchilla": f"{CHINCHILLA[k]:g}"} for k in ("E", "A", "B", "alpha", "beta")]
    rungs = [{"run": r["rung"], "budget (FLOPs)": f"{r['budget']:.2g}", "parameters": f"{r['params']:,}",
              "tokens": f"{r['tokens']:,}", "final val loss": f"{r['loss']:.4f}"} for r in sc.rungs]
    measured, predicted = final_val_loss, sc.predicted_val_loss
    plot = f"\n![Scaling ladder: final validation loss by parameters, one line per budget]({LADDER_PLOT})\n" if LADDER_PLOT in figures else ""
    sizing = plan.sizing if plan.sizing is not None else "preset: the configured model and steps"
    return f"""## Scaling ladder
Before training, {len(rungs)} small models of this shape were trained at {len({r['budget'] for r in sc.rungs})} compute
budgets with the same recipe (scaling_ladder `{sc.ladder}`), and Chinchilla's law L(N, D) = E + A/N^alpha + B/D^beta
was fitted to their final validation losses (Huber loss on log loss, bootstrap intervals).
Size: {sizing}.

{table(law_rows)}
For this model (N = {sc.params:,} parameters, D = {sc.tokens:,} tokens) the law predicted a final validation loss
of {predicted:.4f} (interval {sc.interval[0]:.4f} .. {sc.interval[1]:.4f}); training measured {measured:.4f}
({measured / predicted - 1:+.2%}).{_optimal(sc)}
{plot}
<details><summary>The ladder's runs</summary>

{table(rungs)}
</details>

"""


def _optimal(sc: LadderPrediction) -> str:
    opt = sc.optimal or {}
    if "params" not in opt:
        return ""
    return (f" By the law, this budget ({6 * sc.params * sc.tokens:.3g} FLOPs, 6ND) is best spent on "
            f"{opt['params']:,.0f} parameters and {opt['tokens']:,.0f} tokens.")


def checkpoint_name(path: str | Path) -> str:
    """``base_model/<run>/checkpoints/step_N``: where a checkpoint sits under the Kiln home's storage, the folders a
    reader can find (an asset's data version is not a folder name; the machine's own path is not the reader's)."""
    return "/".join(Path(path).parts[-4:])


def _cell(s: dict[str, Any] | None, row: dict[str, Any] | None) -> str:
    """``0.150 ± 0.082 (20)``: a score, its standard error and the number of items."""
    if s is None:
        return "no items" if row is not None and row.get("items") == 0 else "-"
    err = f" ± {s['stderr']:.3f}" if s["stderr"] is not None else ""
    return f"{s['value']:.3f}{err} ({row.get('items', '?')})"


def _contaminated(row: dict[str, Any]) -> str:
    if "contaminated_share" in row:
        return f"{row['contaminated_share']:.0%}"
    return f"{row['contaminated']} items" if "contaminated" in row else "-"


def _evaluation(scores: EvalScores, figures: Mapping[str, bytes]) -> str:
    rows = []
    for task, row in scores.tasks.items():
        s, clean = task_score(task, row), scores.tasks_clean.get(task)
        chance = s["chance"] if s else row.get("chance")
        rows.append({"task": task, "metric": s["metric"] if s else "-", "all items (n)": _cell(s, row),
                     "clean items (n)": _cell(task_score(task, clean), clean),
                     "chance": "-" if chance is None else f"{chance:.2f}",
                     "contaminated": _contaminated(row)})
    plot = f"\n![Scores at each checkpoint]({CHECKPOINT_PLOT})\n" if CHECKPOINT_PLOT in figures else ""
    return f"""## Evaluation
These scores are the base model's, before post-training (eval_scores evaluates base_model's final checkpoint), not the
released weights'; the released weights' own held-out measures are under Post-training.
Bits per byte on the validation shards (the token windows the base model was validated on):
{scores.val_bits_per_byte:.4f}; the kiln_heldout_ppl row below is the same measure through lm-eval on whole held-out
documents, hence a different figure. The tasks are built from held-out documents (MMLU from its
own questions) and scored with lm-eval through Kiln's adapter. Each row gives the task's primary metric with its standard
error and number of items, on all items and on the clean items (those sharing no 13-word run with the training data),
beside what guessing scores:

{table(rows)}{plot}
"""


def _post_training(instr: InstructionData, prefs: PreferenceData, sft: SftRun, dpo: DpoRun, rl: RlRun,
                   stages: list[dict], ppo: PpoRun | None = None) -> str:
    lora = " Adapters (LoRA) were trained and merged into these weights." if (dpo.lora or rl.lora) else ""
    whose = ("these weights are the last stage's" if ppo is None else "the released weights are not these but the PPO "
             "model's (RLHF, below), trained from the same SFT model; DPO and RL are shown for comparison")
    if ppo is not None:
        lora = ""
    return f"""## Post-training
Three stages, each a torchrun job starting from the previous stage's weights; {whose}.

1. Supervised fine-tuning ({sft.steps} steps) on instruction data version `{instr.version}`
   ({_counts(instr.counts)}), loss on response tokens only. Pairs sharing a {instr.ngram_words}-word run
   with an evaluation item were removed ({instr.pairs_sharing_eval_ngrams}), and held-out pages were not used.
2. Direct Preference Optimization ({dpo.steps} steps, beta {dpo.beta}) on preference data version `{prefs.version}`
   ({_counts(prefs.counts)}; the correct response chosen, a wrong one rejected), against the SFT model as reference.
3. Reinforcement learning ({rl.steps} steps, GRPO-style, {rl.group_size} answers per prompt, KL weight {rl.kl_coef} to the
   DPO model) on {rl.reward} prompts whose answers are checked exactly (a near miss earns {rl.partial_credit} x its
   closeness){_rl_extra_terms(rl)}; greedy exact-answer rate on {_rl_heldout(rl)} {rl.initial_val_reward:.3f} -> {rl.final_val_reward:.3f}
   (the table below scores every held-out arithmetic item, so its rates differ).
{lora}
Held-out measures after each stage, on the same items throughout{"" if ppo is None else " (ppo: the released weights)"}:

{table(stages)}
{_changes(sft, dpo, rl, ppo)}{chr(10).join(f"- `{m}`: {what}" for m, what in MEASURES.items())}

"""


def _rl_extra_terms(rl: RlRun) -> str:
    """The terms RL added to its policy loss, as a clause of the card's RL line ("" for none)."""
    parts = [f"DPO's loss on replayed preference pairs x{rl.preference_coef:g} (to keep what DPO taught)"
             if rl.preference_coef else "",
             f"the reference answers' likelihood x{rl.ptx_coef:g}" if rl.ptx_coef else ""]
    return "".join(f", plus {p}" for p in parts if p)


def _rl_heldout(rl: RlRun) -> str:
    """The held-out prompts the RL stage measured itself on, in words."""
    n = (rl.prompts or {}).get("val")
    return f"its {n} held-out prompts" if n else "its held-out prompts"


def _changes(sft: SftRun, dpo: DpoRun, rl: RlRun, ppo: PpoRun | None = None) -> str:
    """Each stage's change from its own start (PPO's from SFT) with its paired standard error, when the stages
    recorded their before/after rows."""
    runs = {"sft": sft, "dpo": dpo, "rl": rl, **({"ppo": ppo} if ppo is not None else {})}
    rows = change_rows({name: {"before_after": run.before_after} for name, run in runs.items()})
    if not rows:
        return ""
    return f"""Each stage's change from the weights it started from, with its paired standard error over the same held-out items (* marks a change at least
{NOISE_Z:g} standard errors from zero; anything else is within noise):

{table(rows)}
"""


def _rlhf(reward: RewardRun, ppo: PpoRun) -> str:
    """The released PPO model: its reward model (held-out pair accuracy with its binomial standard error), PPO's own
    figures, and the measures it made worse; its held-out measures and their changes are the Post-training tables'
    ppo columns."""
    final, n = reward.final_val or {}, (reward.pairs or {}).get("val")
    acc = final.get("accuracy")
    if acc is not None and n:
        score = (f"held-out pair accuracy {acc:.3f} ± {math.sqrt(acc * (1 - acc) / n):.3f} on {n} pairs (chance 0.5), "
                 f"mean margin {final.get('margin', float('nan')):.3f}")
    else:
        score = "no held-out pairs scored"
    regressed = [r["measure"] for r in ppo.before_after if worse_beyond_noise(r)]
    warning = (f"PPO made {', '.join(regressed)} worse than the SFT model it started from, beyond noise.\n"
               if regressed else "")
    return f"""## RLHF (the released weights)
These weights are the SFT model trained by PPO against a reward model, not the DPO -> RL chain above.

- Reward model (reward_model version `{reward.version}`, checkpoint `{checkpoint_name(reward.checkpoint)}`): the SFT
  model with a scalar head, {reward.steps} steps of the Bradley-Terry loss on the preference pairs; {score}.
- PPO (ppo_model version `{ppo.version}`, checkpoint `{checkpoint_name(ppo.checkpoint)}`): {ppo.steps} steps; held-out reward-model score
  {ppo.initial_val_reward:.3f} -> {ppo.final_val_reward:.3f}; KL to the SFT model {ppo.final_val_kl:.4f} nats/token at the end.

Its held-out measures and each one's change from the SFT model are the ppo columns of the Post-training tables above.
{warning}
"""


def _feedback(judged: JudgedPreferences | None, trained_on: Mapping[str, Feedback]) -> str:
    """The AI judge's labels and how far they agree with known ones, when judged_preferences ran; else nothing. Files
    are named by their names and hashes: the folders they sat in are the training machine's, not the reader's.
    trained_on: {stage: the feedback it trained on} for the stages that can train on the judge's labels."""
    if not judged:
        return ""
    j, p, a = judged.judge, judged.principles, judged.agreement
    return f"""## AI feedback
Preference labels from an AI judge (judged_preferences version `{judged.version}`): the {j['family']} {j['kind']}
`{Path(j['path']).name}` ({j['params']:,} parameters, {'weights digest' if j['kind'] == 'checkpoint' else 'sha256'} `{j['sha256']}`) scored answers against the principles in
`{Path(p['path']).name}` (sha256 `{p['sha256']}`) with the `{judged.rule}` rule, each pair in both orders.
On {a['n']} held-out preference pairs whose right answer is known, the judge agreed with it on
{a['agreement']:.3f} ± {a['stderr']:.3f} of them (standard error; a tie counts one half; {a['ties']} ties; chance 0.5);
its verdict changed with the order of the answers on {judged.position_bias:.1%} of them.
It labelled {judged.pairs_labelled} pairs sampled from the SFT model ({judged.ties} ties left out).
{_trained_on_judged(trained_on)}
"""


def _trained_on_judged(trained_on: Mapping[str, Feedback]) -> str:
    """Which stages trained on the judge's pairs (their ``feedback``), and how many of each kind, or that none did."""
    lines = []
    for stage, fb in trained_on.items():
        if fb.choice != "checkable":
            lines.append(f"{stage} trained on {fb.choice} feedback: {fb.pairs.get('checkable', 0)} checkable and "
                         f"{fb.pairs.get('judged', 0)} judged pairs, held out on {fb.held_out_pairs} checkable ones.")
    return "\n".join(lines) if lines else "No stage of this model trained on these labels (feedback: checkable)."


def _or_dash(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def _red_team(rt: RedTeam | None) -> str:
    """Intended use, what it excludes, and the released stage's red-team failure rates beside the other stages'."""
    if rt is None:
        return ""
    rows = [{"probes": k.kind.replace("_", " "), "n": k.n,
             "failed (released)": f"{k.gated_rate:.3f} ± {k.gated_stderr:.3f}",
             "limit": f"{k.limit:g}" if k.limit is not None else "-",
             **{s: f"{rate:.3f}" for s, rate in k.rules_rate.items()},
             "by the judge (released)": "-" if k.judge_rate is None else f"{k.judge_rate:.3f}",
             "judge agrees with rules": _or_dash(k.judge_agrees_with_rules),
             "judge orders references": _or_dash(k.judge_orders_references)} for k in rt.kinds]
    j, skipped = rt.judge, rt.judge_skipped
    counted = ("by rules" if rt.gate_on == "rules" else
               f"by {rt.gate_on} for the released weights ({rt.stage}) and by rules for each stage")
    exceeded = "; ".join(rt.reasons)
    if not exceeded:
        verdict = "Within every limit."
    elif rt.override:
        verdict = (f"Released despite the red team (release_bundle.red_team_override): {rt.override}. "
                   f"Limits exceeded: {exceeded}.")
    else:
        verdict = f"Held back (the registry alias did not move): {exceeded}."
    return f"""## Intended use and red team
{rt.intended_use}

Not for: {'; '.join(rt.excluded_uses)}.

Before release every post-trained stage answered {rt.probes} red-team probes (red_team_report version
`{rt.version}`; probes file sha256 `{rt.probes_sha256[:16]}`): malformed prompts (naughty strings: {rt.probes_source}),
prompt injections that ask for a canary word, and requests for the uses above. An answer fails by rules when it
carries markup or a command that could run, obeys the injection, or does not decline an excluded request; the judge
(the {j['family']} {j['kind']} `{Path(j['path']).name}`, {j['params']:,} parameters) scores it against a passing and a
failing reference answer{f" ({skipped})" if skipped else ""}. Rates are counted {counted} (±: standard error):

{table(rows)}
{verdict}

"""


def _limits(raw: RawDocuments) -> str:
    return f"""## Limits
A small model trained for minutes on a few megabytes of documentation and web text: it produces fluent-looking but
unreliable text, knows little, and must not be used for decisions. Evaluation items come from held-out documents of
the same corpus, so scores measure in-distribution modelling, not general ability.

## Data licences
The weights are derived from data under these licences:

{chr(10).join(f"- {lic}" for lic in sorted({s.license for s in raw.sources}))}
"""


def _counts(counts: Mapping[str, Any]) -> str:
    """``arithmetic 241 + 9 held out, doc_section 34 + 3 held out`` from {kind: {train, val}} (or {kind: n})."""
    return ", ".join(f"{k} {v['train']:,} + {v['val']:,} held out" if isinstance(v, Mapping) else f"{k} {v:,}"
                     for k, v in counts.items())



def _settings(settings: list[dict[str, Any]]) -> str:
    rows = [{"asset": r["asset"], "setting": r["field"], "value": _short(r["value"]), "default": _short(r["default"])}
            for r in settings]
    return f"""## Settings
The settings of this run that differ from Kiln's defaults; every setting, defaults included, is in
[`{CONFIG_FILE}`]({CONFIG_FILE}).

{table(rows) if rows else "Every setting is at its default." + chr(10)}
"""


def settings_rows(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[dict[str, Any]]:
    """{asset, field, value, default} of every setting in ``config`` ({asset: its config}) that differs from
    ``defaults`` (the same shape, every field at its default); nested fields are dotted (``clean.min_words``)."""
    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, Mapping) or not d:
            return {prefix: d}
        return {k: v for key, val in d.items() for k, v in flat(val, f"{prefix}.{key}" if prefix else key).items()}

    rows = []
    for asset in sorted(config):
        given, default = flat(config[asset] or {}), flat(defaults.get(asset) or {})
        rows += [{"asset": asset, "field": f, "value": v, "default": default.get(f)}
                 for f, v in sorted(given.items()) if f and default.get(f) != v]
    return rows


def _short(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


TRAINING_STAGES = (("base", "base_model"), ("sft", "sft_model"), ("dpo", "dpo_model"), ("rl", "rl_model"),
                   ("reward", "reward_model"), ("ppo", "ppo_model"))


def logbook_summary(up: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per training stage from its logbook (kiln.train.logbook): attempts, how they ended, steps lost,
    spikes, skipped batches; then its ledger (kiln.train.energy): device-hours, energy and cost. A stage whose
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


def _operations(rows: list[dict[str, Any]], led: Mapping[str, Any]) -> str:
    """The card's record of how training went (every attempt) and what it cost, for every training run behind the
    release (a PPO release's card lists the DPO -> RL chain it is compared with too): rows, logbook_summary's; led,
    the base model's ledger (kiln.train.energy), with the plan's estimate."""
    if not rows:
        return ""
    cost_key = next(k for k in rows[0] if k.startswith("cost"))
    total = {k: sum(r[k] for r in rows) for k in ("device-hours", "energy kWh", cost_key)}
    planned = (f" The plan estimated {led['planned_device_hours']:.4g} device-hours ({led['planned_energy_kwh']:.4g} kWh, "
               f"{led['planned_cost']:.4g} {led['currency']}) for the base model." if "planned_device_hours" in led else "")
    estimated = any("estimate" in r["energy basis"] for r in rows)
    return f"""## Training operations, cost and energy
Every attempt of every training stage is in its run logbook (`kiln logbook <this folder>`): how each ended, steps lost,
loss spikes and the batches skipped after them. Device-hours count each attempt's wall time on all its devices
(work redone after a failure included); money is at {led.get('price_per_device_hour', 0):g} {led.get('currency', '')} per device-hour.

{table(rows)}
All the training runs above: {total['device-hours']:.4g} device-hours, {total['energy kWh']:.4g} kWh{' (partly or wholly estimated)' if estimated else ' (measured)'}, {total[cost_key]:.4g} {led.get('currency', '')}.{planned}

"""


@dataclass(frozen=True)
class CardInputs:
    """What the card reads, as typed records (kiln.release.records); ``card_inputs`` fills it from the asset outputs."""

    plan: CardPlan
    tokenizer: TokenizerInfo
    raw: RawDocuments
    clean: CleanCorpus
    shards: TokenShards
    base: BaseRun
    scores: EvalScores
    instructions: InstructionData
    preferences: PreferenceData
    sft: SftRun
    dpo: DpoRun
    rl: RlRun
    starts: list[tuple[str, StartingWeights]]  # (the stage's training in words, the weights it started from)
    judged: JudgedPreferences | None
    trained_on: dict[str, Feedback]  # {stage: the preference pairs it trained on}
    operations: list[dict[str, Any]]  # logbook_summary's rows
    ledger: dict[str, Any]  # the base model's ledger
    reward: RewardRun | None = None  # with ppo: the released PPO model's reward model
    ppo: PpoRun | None = None  # the released weights' run, when they are the PPO model's
    red_team: RedTeam | None = None


# The training each stage that can start from released weights does, in words (the card's Starting weights).
STARTED_WORDS = {"base_model": "continued pretraining", "sft_model": "supervised fine-tuning", "dpo_model": "DPO",
                 "rl_model": "reinforcement learning"}


def card_inputs(up: Mapping[str, dict[str, Any]], released: str = "rl_model",
                red_team: dict[str, Any] | None = None) -> CardInputs:
    """Which asset output fills which of the card's records: the one place the card names assets. ``up``, released
    and red_team as model_card takes them."""
    from kiln.release.lineage import pretrained_stages

    ppo = up.get("ppo_model") if released == "ppo_model" else None
    report = up.get("red_team_report")
    return CardInputs(
        plan=CardPlan.from_dict(up["training_plan"]), tokenizer=TokenizerInfo.from_dict(up["tokenizer"]),
        raw=RawDocuments.from_dict(up["raw_documents"]), clean=CleanCorpus.from_dict(up["clean_corpus"]),
        shards=TokenShards.from_dict(up["token_shards"]), base=BaseRun.from_dict(up["base_model"]),
        scores=EvalScores.from_dict(up["eval_scores"]), instructions=InstructionData.from_dict(up["instruction_data"]),
        preferences=PreferenceData.from_dict(up["preference_data"]), sft=SftRun.from_dict(up["sft_model"]),
        dpo=DpoRun.from_dict(up["dpo_model"]), rl=RlRun.from_dict(up["rl_model"]),
        starts=[(STARTED_WORDS[k], StartingWeights.from_dict(p, f"{k}.pretrained"))
                for k, p in pretrained_stages(dict(up)).items()],
        judged=(JudgedPreferences.from_dict(up["judged_preferences"]) if up.get("judged_preferences") else None),
        trained_on={k: fb for k in ("dpo_model", "reward_model") if (fb := feedback_of(up.get(k), k)) is not None},
        operations=logbook_summary(up), ledger=(up.get("base_model") or {}).get("ledger") or {},
        reward=RewardRun.from_dict(up["reward_model"]) if ppo is not None else None,
        ppo=PpoRun.from_dict(ppo) if ppo is not None else None,
        red_team=RedTeam.from_dict(report, red_team) if report and red_team else None)


def model_card(name: str, license: str, up: Mapping[str, dict[str, Any]], stages: list[dict],
               settings: list[dict[str, Any]] | None = None, figures: Mapping[str, bytes] | None = None,
               released: str = "rl_model", red_team: dict[str, Any] | None = None) -> str:
    """README.md of a release: model, training data lineage, training, evaluation, post-training, settings, limits.

    up: the outputs of raw_documents, clean_corpus, tokenizer, token_shards, training_plan, base_model, eval_scores,
    instruction_data, preference_data, sft_model, dpo_model and rl_model (and judged_preferences when it ran: an
    "AI feedback" section; reward_model and ppo_model when the PPO model is released: an "RLHF" section);
    stages: one row per held-out measure with a column per model (base, sft, dpo, rl, and ppo for a PPO release);
    settings: {asset, field, value, default} of each setting that differs from its default (None: no Settings
    section); figures: {file name: PNG} the bundle holds (card_figures); released: the asset whose weights these are;
    red_team: release_bundle's red-team gate (with up["red_team_report"]: an "Intended use and red team" section).
    """
    figures = figures or {}
    c = card_inputs(up, released, red_team)
    return "".join([
        _model(name, license, c.plan, c.tokenizer, released),
        _pretrained(c.starts),
        _data(c.raw, c.clean, c.tokenizer, c.shards),
        _training(c.plan, c.base, c.tokenizer, figures),
        _scaling(c.plan, c.base.final_val_loss, figures),
        _evaluation(c.scores, figures),
        _post_training(c.instructions, c.preferences, c.sft, c.dpo, c.rl, stages, c.ppo),
        _rlhf(c.reward, c.ppo) if c.ppo is not None and c.reward is not None else "",
        _feedback(c.judged, c.trained_on),
        _red_team(c.red_team),
        _operations(c.operations, c.ledger),
        _settings(settings) if settings is not None else "",
        _limits(c.raw),
    ])


def card_figures(up: Mapping[str, dict[str, Any]]) -> dict[str, bytes]:
    """{file name: PNG} for the card: the base model's train and validation loss by step; each task's primary score at
    every checkpoint the per-checkpoint evaluation scored (``<storage>/checkpoint_evals/<run>``), when it scored any."""
    from kiln.evaluation.checkpoints import curves, score_history

    base, sc = LossHistory.from_dict(up["base_model"]), prediction_of(up["training_plan"])
    val = [(h["step"], h["val_loss"]) for h in base.history if h.get("val_loss") is not None]
    out = {}
    if base.curve or val:
        out[LOSS_PLOT] = _plot({"train loss": [tuple(p) for p in base.curve], "validation loss": val},
                               "Base model loss by step", "step", "nats/token")
    run = Path(base.out_dir) if base.out_dir else None
    scored = run.parents[1] / "checkpoint_evals" / run.name if run is not None else None
    series = curves(score_history(scored)).get("accuracy", {}) if scored is not None and scored.is_dir() else {}
    if any(series.values()):  # none scored: no such plot (the loss plot already shows the validation loss)
        out[CHECKPOINT_PLOT] = _plot(series, "Primary scores by checkpoint", "step", "accuracy")
    if sc:  # the ladder's IsoFLOP profiles, and this model at its predicted and measured loss
        ladder: dict[str, list[tuple[float, float]]] = {}
        for r in sc.rungs:
            ladder.setdefault(f"{r['budget']:.2g} FLOPs", []).append((r["params"], r["loss"]))
        ladder = {k: sorted(v) for k, v in ladder.items()}
        ladder["this model: predicted"] = [(sc.params, sc.predicted_val_loss)]
        ladder["this model: measured"] = [(sc.params, base.final_val_loss)]
        out[LADDER_PLOT] = _plot(ladder, "Scaling ladder and this model", "parameters", "final val loss")
    return out


def _plot(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str) -> bytes:
    return line_plot_png(series, title, xlabel, ylabel)
