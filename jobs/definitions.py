"""The Kiln Definitions: every asset, the resources they share, the pipeline job and the nightly evaluation.

``dagster dev`` (through workspace.yaml) and ``kiln run`` both load ``defs`` from here.
"""

from __future__ import annotations

from pathlib import Path

from dagster import (
    AssetSelection,
    DefaultScheduleStatus,
    Definitions,
    FilesystemIOManager,
    ScheduleDefinition,
    define_asset_job,
    in_process_executor,
)

from assets.collect import clean_corpus, raw_documents
from assets.tokens import token_shards, tokenizer
from assets.evaluation import eval_scores
from assets.posttrain import instruction_data, sft_model
from assets.release import release_bundle
from assets.training import base_model, training_plan
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource

PROJECT = Path(__file__).resolve().parent.parent
KILN_HOME = PROJECT / ".kiln"

ALL_ASSETS = [raw_documents, clean_corpus, tokenizer, token_shards, training_plan, base_model, eval_scores,
              instruction_data, sft_model, release_bundle]

kiln_pipeline_job = define_asset_job(
    "kiln_pipeline_job", selection=AssetSelection.all(), description="Raw text to released model: every Kiln asset in order."
)
nightly_eval_job = define_asset_job(
    "nightly_eval_job", selection=AssetSelection.assets("eval_scores"), description="Re-score the current base model."
)
nightly_eval_schedule = ScheduleDefinition(
    name="nightly_eval_schedule",
    job=nightly_eval_job, cron_schedule="0 2 * * *", default_status=DefaultScheduleStatus.STOPPED,
    description="Evaluates the latest base model every night at 02:00.",
)


def make_resources(home: Path = KILN_HOME, source_cache: str = "") -> dict:
    """Resources rooted at ``home`` (the project's .kiln folder by default; tests pass a temporary one)."""
    return {
        "storage": KilnStorageResource(root=str(home / "storage"), source_cache=source_cache),
        "mlflow": MlflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "mlartifacts")),
        "torchrun": TorchrunResource(),
        "io_manager": FilesystemIOManager(base_dir=str(home / "storage" / "handles")),
    }


def make_definitions(home: Path = KILN_HOME, source_cache: str = "") -> Definitions:
    return Definitions(
        assets=ALL_ASSETS,
        jobs=[kiln_pipeline_job, nightly_eval_job],
        schedules=[nightly_eval_schedule],
        resources=make_resources(home, source_cache),
        executor=in_process_executor,
    )


defs = make_definitions()
