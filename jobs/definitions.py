"""The Kiln Definitions: every asset, the resources they share, the pipeline job and the nightly evaluation.

``dagster dev`` (through workspace.yaml) and ``kiln run`` both load ``defs`` from here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dagster import (
    AssetSelection,
    Definitions,
    define_asset_job,
    in_process_executor,
)

from assets.ablation import ablation, ablation_grid, ablation_report
from assets.collect import clean_corpus, raw_documents
from assets.tokens import token_shards, tokenizer
from assets.evals import benchmark_matrix, checkpoint_evals, contamination_below_threshold, contamination_report, eval_scores, eval_suite
from assets.feedback import judged_preferences
from assets.alignment import dpo_model, instruction_data, preference_data, rl_model, sft_model
from assets.pretrained import pretrained_model
from assets.publish import release_bundle, release_no_regression, release_red_team
from assets.redteam import red_team_report
from assets.rlhf import ppo_model, reward_model
from assets.scaling import scaling_ladder, sweep, sweep_grid, sweep_results
from assets.training import base_model, training_plan
from jobs.nightly import benchmark_matrix_job, checkpoint_eval_job, new_checkpoint_sensor, nightly_eval_schedule
from resources.ray import RayResource
from resources.storage import HandleIOManager, KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource

PROJECT = Path(__file__).resolve().parent.parent
KILN_HOME = Path(os.environ.get("KILN_HOME") or PROJECT / ".kiln")  # make ui sets it to the home it serves

ALL_ASSETS = [pretrained_model, raw_documents, clean_corpus, tokenizer, token_shards, scaling_ladder, training_plan,
              base_model, eval_suite, contamination_report, eval_scores, instruction_data, preference_data, sft_model,
              dpo_model, rl_model, judged_preferences, reward_model, ppo_model, red_team_report, release_bundle]
# assets `kiln run` leaves out unless --select names them or the preset opts in (its top-level opt_in list);
# the pipeline job itself (and the smoke end-to-end test) holds them
OPT_IN = ("scaling_ladder", "judged_preferences", "reward_model", "ppo_model")
# outside the pipeline job: checkpoint_evals (one partition per training checkpoint), benchmark_matrix (one per
# checkpoint and standard benchmark) and the sweep (sweep_grid
# makes sweep's partitions, one per point, which must all run before sweep_results): ``kiln sweep`` runs them
# and the data ablation (ablation_grid makes ablation's partitions; ablation_report reads them): ``kiln ablate``
PARTITIONED_ASSETS = [checkpoint_evals, benchmark_matrix, sweep, ablation]
SWEEP_ASSETS = [sweep_grid, sweep_results, ablation_grid, ablation_report]

PIPELINE_DESCRIPTION = "Raw text to released model: every Kiln asset in order."
kiln_pipeline_job = define_asset_job("kiln_pipeline_job", selection=AssetSelection.assets(*ALL_ASSETS),
                                     description=PIPELINE_DESCRIPTION)
sweep_grid_job = define_asset_job("sweep_grid_job", selection=AssetSelection.assets(sweep_grid),
                                  description="Expand a sweep's grid into partitions of sweep (then run sweep_job on each).")
sweep_job = define_asset_job("sweep_job", selection=AssetSelection.assets(sweep),  # partitioned as sweep is
                             description="One point of the sweep (a partition of sweep); backfill every partition.")
sweep_results_job = define_asset_job("sweep_results_job", selection=AssetSelection.assets(sweep_results),
                                     description="Rank the sweep's points once every partition of sweep has run.")
ablation_grid_job = define_asset_job("ablation_grid_job", selection=AssetSelection.assets(ablation_grid),
                                     description="Expand a data ablation into partitions of ablation and fix its evaluation set.")
ablation_job = define_asset_job("ablation_job", selection=AssetSelection.assets(ablation),
                                description="One point of the data ablation (a partition of ablation); backfill every partition.")
ablation_report_job = define_asset_job("ablation_report_job", selection=AssetSelection.assets(ablation_report),
                                       description="Compare every point with the baseline once every partition of ablation has run.")


def launchpad_job(home: Path):
    """kiln_pipeline_job with the op settings of the home's latest ``kiln run`` preset (HOME/preset.json) as its
    default run config, so that the UI's launchpad (the whole job, or assets picked in its graph) opens with the
    preset the home was built with; the plain job when none was recorded or the record no longer fits the config
    schema (a field renamed since), saying so."""
    from dagster import DagsterInvalidConfigError, DagsterInvalidDefinitionError

    from jobs.home import recorded_preset

    record = recorded_preset(home)
    if not record:
        return kiln_pipeline_job
    job = define_asset_job("kiln_pipeline_job", selection=AssetSelection.assets(*ALL_ASSETS), config={"ops": record["ops"]},
                           description=f"{PIPELINE_DESCRIPTION} The launchpad opens with preset {record['preset']}, "
                                       "the one this home's latest kiln run used.")
    try:  # the default config is checked against the schema when the job's config schema is built
        Definitions(assets=ALL_ASSETS + PARTITIONED_ASSETS + SWEEP_ASSETS, jobs=[job], resources=make_resources(home)).resolve_job_def("kiln_pipeline_job").run_config_schema
    except (DagsterInvalidConfigError, DagsterInvalidDefinitionError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if line.startswith("Error 1")), lines[0] if lines else type(e).__name__)
        print(f"kiln: preset {record['preset']} recorded in {home} does not fit the current config ({why.split('. Expected')[0]}); "
              "the launchpad starts from the defaults", file=sys.stderr)
        return kiln_pipeline_job
    return job


def make_resources(home: Path = KILN_HOME, source_cache: str = "") -> dict:
    """Resources rooted at ``home`` (the project's .kiln folder by default; tests pass a temporary one)."""
    return {
        "storage": KilnStorageResource(root=str(home / "storage"), cache=str(home / "cache"), source_cache=source_cache),
        "mlflow": MlflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "mlartifacts")),
        "torchrun": TorchrunResource(),
        "ray": RayResource(),  # used only when clean.executor is ray
        "io_manager": HandleIOManager(base_dir=str(home / "storage" / "handles")),
    }


def complete_resource_config(run_config: dict, resources: dict) -> dict:
    """Fill each resource block of ``run_config`` with the bound resource's values for the fields it leaves out.

    Dagster replaces a resource's whole configuration when run config names it, so a preset that sets only
    ``mlflow.tracking_uri`` would otherwise send artifact_root (and every other field) back to the class
    defaults instead of the values bound here. Unknown resources and fields are left for Dagster to reject."""
    blocks = run_config.get("resources") or {}
    if not blocks:
        return run_config
    out = {}
    for name, block in blocks.items():
        bound = resources.get(name)
        given = dict((block or {}).get("config") or {})
        base = bound.model_dump() if hasattr(bound, "model_dump") else {}
        out[name] = {**(block or {}), "config": {**base, **given}}
    return {**run_config, "resources": out}


def make_definitions(home: Path = KILN_HOME, source_cache: str = "", launchpad: bool = False, **resources) -> Definitions:
    """Kiln's Definitions over ``home``; keyword arguments bind other resources by name (an MLflow resource whose
    links point at another UI, say). launchpad: kiln_pipeline_job's default run config is the home's recorded preset
    (``launchpad_job``; for the UI: ``kiln run`` passes every setting itself and must not inherit another preset's)."""
    return Definitions(
        assets=ALL_ASSETS + PARTITIONED_ASSETS + SWEEP_ASSETS,
        asset_checks=[contamination_below_threshold, release_no_regression, release_red_team],
        jobs=[launchpad_job(home) if launchpad else kiln_pipeline_job, checkpoint_eval_job, benchmark_matrix_job, sweep_grid_job, sweep_job,
              sweep_results_job, ablation_grid_job, ablation_job, ablation_report_job],
        schedules=[nightly_eval_schedule],
        sensors=[new_checkpoint_sensor],
        resources={**make_resources(home, source_cache), **resources},
        executor=in_process_executor,
    )


def __getattr__(name: str):
    """``defs`` (what workspace.yaml loads), built on first use: its launchpad reads KILN_HOME's recorded preset,
    which the commands that import this module for its parts (kiln run, kiln status) never need."""
    if name == "defs":
        globals()["defs"] = make_definitions(launchpad=True)
        return globals()["defs"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
