"""Step 9 as an asset: preference pairs labelled by an AI judge against written principles (RLAIF, Constitutional AI).

The judge is any model Kiln loads (a Hugging Face folder, a release bundle, a checkpoint; by default the run's SFT
model); ``kiln run --select judged_preferences`` labels pairs sampled from the SFT model and measures the judge on pairs
whose right label is known. dpo_model and reward_model train on the labelled pairs when their ``feedback`` is judged
(these alone) or mixed (beside preference_data's).
"""

import random
import time
from pathlib import Path
from typing import Annotated

import torch

from dagster import AssetExecutionContext, MetadataValue, Output, asset
from pydantic import Field

from assets._common import asset_output, failing_on_config_errors, md_table
from assets._config import KilnConfig
from assets.collect import project_path
from kiln.common.config import Domain
from kiln.posttrain import instructions as kinst
from kiln.posttrain import judge as kjudge
from kiln.posttrain.sft import read_pairs
from kiln.tokens.tokenizer import encoding_fingerprint
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource


class JudgedPreferencesConfig(KilnConfig):
    judge: str = Field(default="", description="The judge: a local Hugging Face folder, a release bundle or a Kiln checkpoint. Empty: the run's sft_model.")
    principles: str = Field(default="conf/judge/principles.yaml", description="The principles file (YAML; relative to the project): what each answer is judged against, with weights.")
    rule: str = Field(default="yes_no", description="How the judge is asked (kiln.posttrain.judge.RULES): yes_no scores each answer alone, compare shows both answers and is judged in both orders.")
    checkable_pairs: Annotated[int, Domain(0)] = Field(default=200, description="Held-out preference_data pairs (right label known by construction) the judge's agreement is measured on.")
    prompts: Annotated[int, Domain(1)] = Field(default=32, description="Training prompts whose sampled answers the judge labels.")
    candidates: Annotated[int, Domain(2)] = Field(default=2, description="Answers sampled from the SFT model per prompt; every pair of distinct ones is judged.")
    max_new_tokens: Annotated[int, Domain(1)] = Field(default=32, description="Longest sampled answer, in tokens.")
    temperature: Annotated[float, Domain(0, low_open=True)] = Field(default=1.0, description="Sampling temperature of the candidates.")
    tie_margin: Annotated[float, Domain(0)] = Field(default=1e-3, description="A pair whose judged margin (nats, weighted over principles) is at most this is a tie.")
    seed: Annotated[int, Domain(0)] = Field(default=0, description="Seeds which prompts are used, the sampling and the order known pairs are shown in.")


def _rows(prompts: list[dict], seed: int, n: int) -> list[dict]:
    rows = list(prompts)
    random.Random(seed).shuffle(rows)
    return rows[:n]


def _examples(run: kjudge.JudgingRun, k: int = 3) -> list[dict]:
    """A few judgements for people: known pairs first (with the right answer), then sampled ones."""
    pick = list(zip(run.checkable[:k], run.checkable_verdicts[:k])) + list(zip(run.sampled[:k], run.sampled_verdicts[:k]))
    return [{"prompt": p["prompt"][:60], "A": p["a"][:80], "B": p["b"][:80], "margin (A over B)": v["margin"],
             "verdict": v["verdict"], "flipped with order": v["flipped"], "right answer": p.get("truth", "?")}
            for p, v in pick]


def _summary(run: kjudge.JudgingRun, rows: list[dict]) -> dict:
    """Agreement with the known labels (overall and by kind), ties and position bias, as the value records them."""
    truth = [p["truth"] for p in run.checkable]
    kinds = sorted({p["row"]["kind"] for p in run.checkable})
    by_kind = {k: kjudge.agreement([v for p, v in zip(run.checkable, run.checkable_verdicts) if p["row"]["kind"] == k],
                                   [p["truth"] for p in run.checkable if p["row"]["kind"] == k]) for k in kinds}
    return {"agreement": kjudge.agreement(run.checkable_verdicts, truth), "agreement_by_kind": by_kind,
            "position_bias": {"checkable": kjudge.position_bias(run.checkable_verdicts),
                              "sampled": kjudge.position_bias(run.sampled_verdicts)},
            "pairs_judged": len(run.sampled), "pairs_labelled": len(rows),
            "ties": sum(v["verdict"] == "tie" for v in run.sampled_verdicts), "identical_skipped": run.identical}


def _metadata(value: dict, run: kjudge.JudgingRun, principles: kjudge.Principles, wall_s: float) -> dict:
    s, j = value["summary"], value["judge"]
    agree = s["agreement"]
    return {
        "judge": md_table([{k: j[k] for k in ("path", "kind", "sha256", "family", "params", "same_tokenizer")}]),
        "principles": md_table([{"n": i + 1, "name": p.name, "weight": p.weight, "text": p.text}
                                for i, p in enumerate(principles.principles)]),
        "principles_file": MetadataValue.path(value["principles"]["path"]), "principles_sha256": value["principles"]["sha256"],
        "rule": f"{value['rule']}: {kjudge.RULES[value['rule']].about}",
        "agreement": agree["agreement"], "agreement_stderr": agree["stderr"], "agreement_n": agree["n"],
        "agreement_by_kind": md_table([{"kind": k, **v} for k, v in s["agreement_by_kind"].items()]),
        "checkable_ties": agree["ties"], "position_bias_rate": s["position_bias"]["checkable"],
        "position_bias_rate_sampled": s["position_bias"]["sampled"],
        "pairs_labelled": s["pairs_labelled"], "ties": s["ties"], "identical_skipped": s["identical_skipped"],
        "examples": md_table(_examples(run)), "wall_s": round(wall_s, 2), "path": MetadataValue.path(value["path"]),
    }


def _write(stage: Path, run: kjudge.JudgingRun, rows: list[dict]) -> None:
    kinst.write_jsonl(rows, stage / "preferences.jsonl")
    kinst.write_jsonl([{"checkable": True, **kjudge.judgement_record(p, v)} for p, v in zip(run.checkable, run.checkable_verdicts)]
                      + [{"checkable": False, **kjudge.judgement_record(p, v)} for p, v in zip(run.sampled, run.sampled_verdicts)],
                      stage / "judgements.jsonl")


def _checked_inputs(config: JudgedPreferencesConfig, sft_model: dict):
    """(principles path, principles, judge identity), a config mistake failing the step without retries."""
    with failing_on_config_errors():
        ppath = project_path(config.principles)
        principles = kjudge.read_principles(ppath)
        kjudge.rule_of(config.rule, "judged_preferences.rule")
        ident = kjudge.judge_fingerprint(config.judge or sft_model["checkpoint"], "judged_preferences.judge")
    return ppath, principles, ident


@asset(code_version="2", group_name="posttraining")
def judged_preferences(context: AssetExecutionContext, config: JudgedPreferencesConfig, instruction_data: dict,
                       preference_data: dict, sft_model: dict, tokenizer: dict, training_plan: dict,
                       storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Preference pairs labelled by an AI judge (by default the SFT model) against written principles: two answers per training prompt sampled from the SFT model, each pair judged in both orders from the judge's own yes/no probabilities; the judge's agreement with held-out pairs whose right label is known, its ties and position bias; the same JSONL format as preference_data."""
    device = training_plan["hardware"]["device"]
    device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    ppath, principles, ident = _checked_inputs(config, sft_model)
    psha = kjudge.file_sha256(ppath)
    with asset_output(context, mlflow, parent=storage.path("judged_preferences"), config=config,
                      inputs={"preference_data": preference_data, "sft_model": sft_model},
                      reuse={"judge": ident["sha256"], "principles_sha256": psha}) as out:
        if out.reused:
            return out.reused
        t0 = time.perf_counter()
        judge = kjudge.load_judge(ident["path"], device, "judged_preferences.judge")
        policy = judge if not config.judge else kjudge.load_judge(sft_model["checkpoint"], device, "sft_model")
        known = read_pairs(preference_data["path"], "val")[: config.checkable_pairs]
        prompts = _rows(read_pairs(instruction_data["path"], "train"), config.seed, config.prompts)
        run = kjudge.run_judging(
            judge, principles, known, prompts, policy.model, policy.enc,
            rule=config.rule, candidates=config.candidates, max_new_tokens=config.max_new_tokens,
            temperature=config.temperature, tie_margin=config.tie_margin, seed=config.seed, device=device)
        rows = kjudge.labelled_rows(run.sampled, run.sampled_verdicts)
        _write(out.stage, run, rows)
        final = out.commit()
        wall = time.perf_counter() - t0
        value = {"path": str(final / "preferences.jsonl"), "judgements": str(final / "judgements.jsonl"),
                 "version": out.version, "counts": kinst.split_counts(rows, "kind"),
                 "judge": {**judge.identity, "same_tokenizer": encoding_fingerprint(judge.enc) == tokenizer["fingerprint"]},
                 "principles": {"path": str(ppath), "sha256": psha}, "rule": config.rule, "summary": _summary(run, rows)}
        a = value["summary"]["agreement"]
        out.log_metrics({"agreement": a["agreement"], "agreement_stderr": a["stderr"], "pairs": len(rows),
                         "position_bias": value["summary"]["position_bias"]["checkable"], "wall_s": wall})
        context.log.info(f"judge {ident['kind']} {ident['path']}: agreement {a['agreement']:.3f} ± {a['stderr']:.3f} "
                         f"(n={a['n']}) with known labels; {len(rows)} pairs labelled in {wall:.1f}s")
        return out.result(value, _metadata(value, run, principles, wall))
