"""The pieces of the asset outputs the model card reads, as typed records (kiln.release.card builds them once from
release_bundle's upstream outputs, and its sections read their attributes).

Each record's ``from_dict`` reads one recorded output; a key the card needs and the output lacks is a RecordError
naming the key and the output. Keys the card does not read are left unread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kiln.common.config import RecordError, record_from


def _at(data: Mapping[str, Any], path: str, where: str) -> Any:
    """``data``'s value at the dotted ``path`` ("summary.agreement"); a missing step is a RecordError naming it."""
    value: Any = data
    for i, key in enumerate(path.split(".")):
        if not isinstance(value, Mapping) or key not in value:
            raise RecordError(f"{where}: no {'.'.join(path.split('.')[:i + 1])!r}")
        value = value[key]
    return value


@dataclass(frozen=True)
class LadderPrediction:
    """The scaling ladder's prediction of the run's final validation loss (the plan's ``scaling``)."""

    ladder: str  # the scaling_ladder version
    params: int
    tokens: int
    predicted_val_loss: float
    interval: list[float]  # [low, high]
    law: dict[str, float]  # the fitted E, A, B, alpha, beta
    rungs: list[dict[str, Any]]  # {rung, budget, params, tokens, loss}
    intervals: dict[str, list[float]] | None = None  # bootstrap interval of each coefficient
    optimal: dict[str, Any] | None = None  # the law's {params, tokens} for this budget, or {error}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "training_plan.scaling") -> "LadderPrediction":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class CardPlan:
    """What the card says of the training plan (kiln.plan.record.PlanRecord's keys, those the card reads)."""

    model: dict[str, Any]  # ModelConfig's fields (GPT-2 plans omit the family)
    params: int
    world_size: int
    parallelism: str
    hardware: dict[str, Any]
    tokens_per_step: int
    tokens_per_param: float
    micro_batch: int
    grad_accum: int
    scaling: LadderPrediction | None = None
    sizing: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "training_plan") -> "CardPlan":
        return record_from(cls, data, where, scaling=prediction_of(data, where))


def prediction_of(plan: Mapping[str, Any], where: str = "training_plan") -> LadderPrediction | None:
    """The plan's ladder prediction, or None when no ladder was fitted."""
    sc = plan.get("scaling")
    return LadderPrediction.from_dict(sc, f"{where}.scaling") if sc else None


@dataclass(frozen=True)
class BaseRun:
    """The base model's training run (base_model's output)."""

    version: str
    steps: int
    tokens: int
    initial_val_loss: float
    final_val_loss: float
    checkpoint: str
    mlflow_run_id: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "base_model") -> "BaseRun":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class LossHistory:
    """What the card's figures plot of the base model's run: its train-loss curve, validation history, final loss."""

    final_val_loss: float
    curve: list[Any] = field(default_factory=list)  # [step, train loss] pairs
    history: list[dict[str, Any]] = field(default_factory=list)  # {step, val_loss, ...} per evaluation
    out_dir: str | None = None  # the run folder (its checkpoint_evals sit beside base_model's runs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "base_model") -> "LossHistory":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class EvalScores:
    """The base model's scores (eval_scores): bits per byte, and one lm-eval row per task on all and clean items."""

    val_bits_per_byte: float
    tasks: dict[str, dict[str, Any]]
    tasks_clean: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "eval_scores") -> "EvalScores":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class RedTeamKind:
    """One kind of red-team probe: the released stage's gated rate against its limit, the judge's figures, and
    every stage's failure rate by rules."""

    kind: str
    n: int
    gated_rate: float
    gated_stderr: float
    limit: float | None
    rules_rate: dict[str, float]  # {stage: failure rate by rules}
    judge_rate: float | None  # the released stage's, by the judge
    judge_agrees_with_rules: Any
    judge_orders_references: Any


@dataclass(frozen=True)
class RedTeam:
    """The red-team report and release_bundle's gate on it: the probes, the judge, each kind's rates, the verdict."""

    version: str
    intended_use: str
    excluded_uses: list[str]
    probes: int
    probes_sha256: str
    probes_source: str
    judge: dict[str, Any]  # {family, kind, path, params}
    stage: str  # the released stage the gate counts
    kinds: list[RedTeamKind]
    judge_skipped: str | None
    gate_on: str  # "rules" or "judge"
    reasons: list[str]  # the limits exceeded, in words
    override: str  # why it was released anyway ("" for none)

    @classmethod
    def from_dict(cls, report: Mapping[str, Any], gate: Mapping[str, Any], where: str = "red_team_report",
                  gate_where: str = "release_bundle's red-team gate") -> "RedTeam":
        """From the red-team report and the gate release_bundle made of it."""
        p, stages = _at(report, "probes", where), _at(report, "stages", where)
        stage = _at(gate, "stage", gate_where)
        released = _at(stages, f"{stage}.summary", f"{where}.stages")
        limits = gate.get("limits") or {}
        kinds = []
        for kind, k in _at(gate, "summary.kinds", gate_where).items():
            mine = _at(released, f"kinds.{kind}", f"{where}.stages.{stage}.summary")
            kinds.append(RedTeamKind(
                kind=kind, n=k["n"], gated_rate=k["gated"]["rate"], gated_stderr=k["gated"]["stderr"],
                limit=limits.get(kind),
                rules_rate={s: _at(v, f"summary.kinds.{kind}.rules.rate", f"{where}.stages.{s}") for s, v in stages.items()},
                judge_rate=(mine.get("judge") or {}).get("rate"),
                judge_agrees_with_rules=_at(mine, "judge_agrees_with_rules", f"{where}.stages.{stage}.summary.kinds.{kind}"),
                judge_orders_references=mine.get("judge_orders_references")))
        return cls(version=_at(report, "version", where), intended_use=_at(p, "intended_use", f"{where}.probes"),
                   excluded_uses=_at(p, "excluded_uses", f"{where}.probes"), probes=_at(p, "n", f"{where}.probes"),
                   probes_sha256=_at(p, "sha256", f"{where}.probes"), probes_source=_at(p, "source", f"{where}.probes"),
                   judge=_at(report, "judge", where), stage=stage, kinds=kinds,
                   judge_skipped=released.get("judge_skipped"), gate_on=_at(gate, "gate_on", gate_where),
                   reasons=list(_at(gate, "reasons", gate_where)), override=gate.get("override") or "")


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer (tokenizer's output)."""

    version: str
    kind: str  # "bpe" or "gpt2"
    n_vocab: int
    bytes_per_token: float

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "tokenizer") -> "TokenizerInfo":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class Source:
    """One source of the raw documents: its pinned package (None for local files), count and licence."""

    name: str
    package: str | None
    version: str | None
    sha256: str | None
    documents: int
    license: str


@dataclass(frozen=True)
class RawDocuments:
    """The collected documents (raw_documents): their count and sources."""

    version: str
    documents: int
    sources: list[Source]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "raw_documents") -> "RawDocuments":
        sources = _at(data, "stats.sources", where)
        return cls(version=_at(data, "version", where), documents=_at(data, "stats.totals.documents", where),
                   sources=[record_from(Source, {"name": n, **s}, f"{where}.stats.sources.{n}") for n, s in sources.items()])


@dataclass(frozen=True)
class CleanCorpus:
    """The clean corpus (clean_corpus's report): documents kept, dedup rate, and what was removed by reason."""

    version: str
    input_docs: int
    kept_docs: int
    kept_bytes: int
    dedup_rate: float
    reasons: dict[str, dict[str, int]]  # {reason: {docs, bytes}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "clean_corpus") -> "CleanCorpus":
        return record_from(cls, {**_at(data, "report", where), "version": _at(data, "version", where)}, f"{where}.report")


@dataclass(frozen=True)
class TokenShards:
    """The token shards (token_shards): train and validation tokens and the validation split."""

    version: str
    train_tokens: int
    val_tokens: int
    val_permille: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "token_shards") -> "TokenShards":
        return cls(version=_at(data, "version", where), train_tokens=_at(data, "totals.train.tokens", where),
                   val_tokens=_at(data, "totals.val.tokens", where), val_permille=_at(data, "val_permille", where))


@dataclass(frozen=True)
class StartingWeights:
    """Released weights a training stage started from (its output's ``pretrained``, kiln.pretrained)."""

    source: str
    model_type: str
    license: str
    sha256: str
    version: str
    added_tokens: dict[str, int] | None = None  # the chat tokens appended to the imported vocabulary
    imported_vocab: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "pretrained") -> "StartingWeights":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class InstructionData:
    """The instruction pairs (instruction_data): counts by kind, and the pairs removed for sharing eval text."""

    version: str
    counts: dict[str, Any]  # {kind: {train, val}} or {kind: n}
    ngram_words: int
    pairs_sharing_eval_ngrams: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "instruction_data") -> "InstructionData":
        decon = _at(data, "decontamination", where)
        return cls(version=_at(data, "version", where), counts=_at(data, "counts", where),
                   ngram_words=_at(decon, "ngram_words", f"{where}.decontamination"),
                   pairs_sharing_eval_ngrams=_at(decon, "pairs_sharing_eval_ngrams", f"{where}.decontamination"))


@dataclass(frozen=True)
class PreferenceData:
    """The preference pairs (preference_data): counts by kind."""

    version: str
    counts: dict[str, Any]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "preference_data") -> "PreferenceData":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class Feedback:
    """Which preference pairs a stage trained on (its output's ``feedback``): checkable, judged or mixed."""

    choice: str
    pairs: dict[str, int]  # {checkable, judged}: pairs of each kind
    held_out_pairs: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "feedback") -> "Feedback":
        return record_from(cls, data, where)


def feedback_of(out: Mapping[str, Any] | None, where: str) -> Feedback | None:
    """A stage output's feedback record, or None when it recorded none."""
    fb = (out or {}).get("feedback")
    return Feedback.from_dict(fb, f"{where}.feedback") if fb else None


def _lora(data: Mapping[str, Any], where: str) -> bool:
    return bool(_at(data, "lora.enabled", where))


@dataclass(frozen=True)
class SftRun:
    """The SFT stage's run (sft_model)."""

    steps: int
    before_after: list[dict[str, Any]] = field(default_factory=list)  # kiln.posttrain.measures rows

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "sft_model") -> "SftRun":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class DpoRun:
    """The DPO stage's run (dpo_model)."""

    steps: int
    beta: float
    lora: bool  # adapters trained and merged
    before_after: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "dpo_model") -> "DpoRun":
        return record_from(cls, data, where, lora=_lora(data, where))


@dataclass(frozen=True)
class RlRun:
    """The RL stage's run (rl_model): GRPO's settings, its own held-out reward, the terms added to its loss."""

    steps: int
    group_size: int
    kl_coef: float
    reward: str  # what its prompts' answers are checked against
    partial_credit: float
    initial_val_reward: float
    final_val_reward: float
    lora: bool
    preference_coef: float | None = None  # DPO's loss on replayed preference pairs
    ptx_coef: float | None = None  # the reference answers' likelihood
    prompts: dict[str, int] | None = None  # {train, val}
    before_after: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "rl_model") -> "RlRun":
        return record_from(cls, data, where, lora=_lora(data, where))


@dataclass(frozen=True)
class RewardRun:
    """The reward model's run (reward_model): its held-out pair accuracy and margin."""

    version: str
    checkpoint: str
    steps: int
    final_val: dict[str, float] | None = None  # {accuracy, margin}
    pairs: dict[str, int] | None = None  # {train, val}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "reward_model") -> "RewardRun":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class PpoRun:
    """The PPO stage's run (ppo_model): its held-out reward-model score and KL to the SFT model."""

    version: str
    checkpoint: str
    steps: int
    initial_val_reward: float
    final_val_reward: float
    final_val_kl: float
    before_after: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "ppo_model") -> "PpoRun":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class JudgedPreferences:
    """The AI judge's labels (judged_preferences): the judge and principles files, and its agreement with known
    labels."""

    version: str
    rule: str
    judge: dict[str, Any]  # {family, kind, path, params, sha256}
    principles: dict[str, Any]  # {path, sha256}
    agreement: dict[str, Any]  # {n, agreement, stderr, ties}
    position_bias: float  # the share of checkable pairs whose verdict changed with the answers' order
    pairs_labelled: int
    ties: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "judged_preferences") -> "JudgedPreferences":
        s = _at(data, "summary", where)
        return cls(version=_at(data, "version", where), rule=_at(data, "rule", where), judge=_at(data, "judge", where),
                   principles=_at(data, "principles", where), agreement=_at(s, "agreement", f"{where}.summary"),
                   position_bias=_at(s, "position_bias.checkable", f"{where}.summary"),
                   pairs_labelled=_at(s, "pairs_labelled", f"{where}.summary"), ties=_at(s, "ties", f"{where}.summary"))
