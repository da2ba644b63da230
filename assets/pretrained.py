"""Step 0 as an asset: released weights to start from, a local Hugging Face folder imported as a Kiln checkpoint and
tokenizer; empty means training from scratch. Set it with ``ops: {pretrained_model: {config: {path: /models/x}}}``.
"""

import json
from pathlib import Path

from dagster import AssetExecutionContext, Config, DataVersion, Failure, MetadataValue, Output, asset
from pydantic import Field

from assets._common import asset_output, md_table
from kiln.common.files import commit_dir, staging_dir
from kiln.pretrained.config import PretrainedError
from kiln.pretrained.source import folder_hash, import_pretrained, is_hf_folder
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

FROM_SCRATCH = {"path": "", "kind": "none", "version": "none"}  # a fixed version: downstream versions stay as they were
LINEAGE_KEYS = ("source", "sha256", "license", "model_type", "architectures", "version", "imported_vocab", "added_tokens")  # what lineage and the card show


class PretrainedModelConfig(Config):
    path: str = Field(default="", description="Local Hugging Face model folder (config.json, model.safetensors or "
                      "sharded safetensors with its index, tokenizer.json) to start from: its tokenizer becomes the "
                      "tokenizer and base_model continues its pretraining. Empty: train from scratch.")


def lineage_of(pretrained: dict) -> dict:
    """The part of an imported model's record that lineage and the model card carry."""
    return {k: pretrained[k] for k in LINEAGE_KEYS if k in pretrained}


def start_of(pretrained: dict) -> dict:
    """What a training plan records of the weights base_model starts from (plain keys: the plan is logged as params)."""
    return {"source": pretrained["source"], "sha256": pretrained["sha256"], "version": pretrained["version"],
            "checkpoint": pretrained["checkpoint"]}


def recorded_start(start: dict) -> dict:
    """The lineage record of an imported checkpoint named by ``start_of``, read from its pretrained.json."""
    folder = Path(start["checkpoint"]).parent.parent  # pretrained_model/<version>/checkpoints/step_0000000
    return {**lineage_of(json.loads((folder / "pretrained.json").read_text())), "version": start["version"]}


def import_folder(storage: KilnStorageResource, path: str, where: str) -> dict:
    """The Kiln checkpoint and tokenizer of a Hugging Face folder, imported once per folder content (its sha256) into
    ``pretrained_model/<sha256[:16]>``; an error fails the asset without retries, naming ``where`` (the config key)."""
    folder = Path(path).expanduser()
    try:
        if not is_hf_folder(folder):
            raise PretrainedError(f"{folder}: no config.json (or a Kiln checkpoint); {where} takes a Hugging Face model "
                                  "folder: config.json, safetensors, tokenizer.json")
        version = folder_hash(folder)[:16]
        final = storage.path("pretrained_model", version)
        if not (final / "pretrained.json").is_file():
            with staging_dir(final.parent) as stage:
                import_pretrained(folder, stage)
                commit_dir(stage, final)
        record = json.loads((final / "pretrained.json").read_text())
    except PretrainedError as e:
        raise Failure(description=f"{where}: {e}", allow_retries=False) from e
    return {**record, "checkpoint": str(final / record["checkpoint"]), "tokenizer": str(final / record["tokenizer"]),
            "dir": str(final), "version": version, "kind": "pretrained", "path": str(folder)}


def metadata_of(value: dict) -> dict:
    return {
        "source": MetadataValue.path(value["source"]), "source_sha256": value["sha256"], "license": value["license"],
        "model_type": value["model_type"], "model": MetadataValue.json(value["model"]),
        "tokenizer": md_table([{"imported tokens": value["imported_vocab"], "n_vocab": value["n_vocab"],
                                "added": ", ".join(f"{t}={i}" for t, i in value["added_tokens"].items()) or "none",
                                "texts checked": value["tokenizer_texts_checked"]}]),
        "notes": MetadataValue.md("; ".join(value["tokenizer_notes"]) or "none"),
        "checkpoint": MetadataValue.path(value["checkpoint"]),
    }


@asset(code_version="1", group_name="data")
def pretrained_model(context: AssetExecutionContext, config: PretrainedModelConfig, storage: KilnStorageResource,
                     mlflow: MlflowResource) -> Output[dict]:
    """Released weights the run starts from: a local Hugging Face folder (GPT-2, Llama, Mistral or Qwen 3; safetensors only) imported as a Kiln checkpoint and tokenizer, with its content hash and licence; or nothing (training from scratch)."""
    if not config.path:
        return Output(dict(FROM_SCRATCH), data_version=DataVersion(FROM_SCRATCH["version"]),
                      metadata={"source": "none: training from scratch"})
    value = import_folder(storage, config.path, "pretrained_model.path")
    with asset_output(context, mlflow, params={"path": value["path"], "sha256": value["sha256"]},
                      reuse={"pretrained": value["version"], "path": value["path"]}) as out:
        if out.reused:
            return out.reused
        out.set_tags({"license": value["license"], "model_type": value["model_type"]})
        return out.result(value, metadata_of(value), version=value["version"])
