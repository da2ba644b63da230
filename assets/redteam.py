"""The red-team report: every post-trained stage answers adversarial and malformed prompts before a release
(kiln.evaluation.redteam); release_bundle's red-team gate reads the released stage's failure rates."""

import time
from typing import Annotated, Optional

import torch
from dagster import AssetExecutionContext, MetadataValue, Output, asset
from pydantic import Field

from assets._common import asset_output, failing_on_config_errors, md_table
from assets._config import KilnConfig
from assets.collect import project_path
from kiln.common.config import Domain
from kiln.common.files import atomic_write_json
from kiln.evaluation import redteam as krt
from kiln.posttrain import instructions as kinst
from kiln.posttrain import judge as kjudge
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource


class RedTeamReportConfig(KilnConfig):
    probes: str = Field(default="conf/redteam/probes.yaml", description="The probes file: intended use, kinds of probe, their rules and judge principles (relative to the project or absolute).")
    malformed_items: Annotated[int, Domain(0)] = Field(default=40, description="Naughty strings asked, a seeded sample of the 200 (0: all).")
    injection_items: Annotated[int, Domain(0)] = Field(default=20, description="Prompt injections asked, a seeded sample of task x text x injection (0: all).")
    max_new_tokens: Annotated[int, Domain(1)] = Field(default=48, description="Tokens of each greedy answer.")
    judge: str = Field(default="", description="The judge model: a Hugging Face folder, release bundle or Kiln checkpoint; empty: the SFT model, as judged_preferences.")
    seed: Annotated[int, Domain(0)] = Field(default=0, description="Seed of the probe samples.")


def _stages(sft_model: dict, dpo_model: dict, rl_model: dict, ppo_model: Optional[dict]) -> dict[str, dict]:
    return {"sft_model": sft_model, "dpo_model": dpo_model, "rl_model": rl_model,
            **({"ppo_model": ppo_model} if ppo_model else {})}


def _rate_rows(value: dict) -> list[dict]:
    rows = []
    for stage, s in value["stages"].items():
        for kind, k in s["summary"]["kinds"].items():
            judge = k["judge"] or {}
            rows.append({"stage": stage, "kind": kind, "n": k["n"], "failed by rules": k["rules"]["rate"],
                         "by judge": judge.get("rate"), "judge agrees": k["judge_agrees_with_rules"],
                         "judge orders references": k["judge_orders_references"]})
    return rows


def _failures(rows: list[dict], k: int = 6) -> list[dict]:
    bad = [r for r in rows if r["rule_failed"]]
    picked = [next(r for r in bad if r["kind"] == kind) for kind in krt.KINDS if any(r["kind"] == kind for r in bad)]
    return [{"kind": r["kind"], "prompt": r["prompt"][:70], "answer": r["response"][:90], "why": r["rule_reason"]}
            for r in (picked + [r for r in bad if r not in picked])[:k]]


def _answer_every_stage(context, out, stages: dict[str, dict], probes: list[dict], spec, judge, config, device: str,
                        value: dict) -> list[dict]:
    """Each stage answers every probe: its rows in ``<stage>.jsonl``, its summary in value["stages"], its rates logged
    to MLflow; returns a few of the released stage's (rl_model's) failures for people."""
    failures: list[dict] = []
    for stage, made in stages.items():
        model = kjudge.load_judge(made["checkpoint"], device, stage)
        rows = krt.answer_and_score(model.model, model.enc, probes, spec, judge, config.max_new_tokens, device)
        kinst.write_jsonl(rows, out.stage / f"{stage}.jsonl")
        summary = krt.summarize(rows)
        value["stages"][stage] = {"version": made["version"], "summary": summary}
        context.log.info(f"red team {stage}: " + ", ".join(
            f"{k} {v['rules']['rate']:.2f}" for k, v in summary["kinds"].items()) + " failed by rules")
        out.log_metrics({f"{stage}.{k}.failure_rate": v["rules"]["rate"] for k, v in summary["kinds"].items()})
        if stage == "rl_model":
            failures = _failures(rows)
    return failures


def _metadata(value: dict, failures: list[dict], wall_s: float) -> dict:
    released = value["stages"]["rl_model"]["summary"]
    return {"failure_rates": md_table(_rate_rows(value)), "probes": value["probes"]["n"],
            "failed_examples (rl_model)": md_table(failures),
            **({"judge_skipped": released["judge_skipped"]} if released.get("judge_skipped") else {}),
            "judge": md_table([{k: value["judge"][k] for k in ("path", "kind", "sha256", "family", "params")}]),
            "probes_file": MetadataValue.path(value["probes"]["path"]), "wall_s": round(wall_s, 1),
            "path": MetadataValue.path(value["dir"])}


@asset(code_version="1", group_name="evaluation")
def red_team_report(context: AssetExecutionContext, config: RedTeamReportConfig, sft_model: dict, dpo_model: dict,
                    rl_model: dict, storage: KilnStorageResource, mlflow: MlflowResource,
                    ppo_model: Optional[dict] = None) -> Output[dict]:
    """Each post-trained stage (SFT, DPO, RL, and PPO when materialized) answers a red-team suite: naughty strings from the pinned evals wheel (malformed input), prompt injections with a canary word, and requests the card's intended use excludes; each answer scored by rules and by a judge model against references; failure rates per stage and kind with standard errors, the judge's agreement with the rules, and failed examples. release_bundle's gate holds a release back above its limits."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with failing_on_config_errors():
        ppath = project_path(config.probes)
        spec = krt.read_probes(ppath)
        judge_id = kjudge.judge_fingerprint(config.judge or sft_model["checkpoint"], "red_team_report.judge")
    probes_sha256 = kjudge.file_sha256(ppath)
    stages = _stages(sft_model, dpo_model, rl_model, ppo_model)
    with asset_output(context, mlflow, parent=storage.path("red_team_report"), config=config,
                      inputs={k: v["version"] for k, v in stages.items()},
                      reuse={"probes_sha256": probes_sha256, "judge": judge_id["sha256"]}) as out:
        if out.reused:
            return out.reused
        t0 = time.perf_counter()
        probes = krt.build_probes(spec, krt.load_naughty_strings(storage.cache_dir), config.malformed_items,
                                  config.injection_items, config.seed)
        judge = kjudge.load_judge(judge_id["path"], device, "red_team_report.judge")
        value = {"probes": {"path": str(ppath), "sha256": probes_sha256, "n": len(probes),
                            "source": krt.NAUGHTY_SOURCE.license, "intended_use": spec.intended_use,
                            "excluded_uses": [u.use for u in spec.excluded_use.uses]},
                 "judge": judge.identity, "stages": {}}
        failures = _answer_every_stage(context, out, stages, probes, spec, judge, config, device, value)
        atomic_write_json(out.stage / "report.json", value)
        final = out.commit()
        value = {**value, "dir": str(final), "version": out.version}
        return out.result(value, _metadata(value, failures, time.perf_counter() - t0))
