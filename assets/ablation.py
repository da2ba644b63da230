"""Data decisions as assets: ablations of the clean step's rules, the source mixture and the vocabulary, each point a
small proxy trained for the same tokens with several seeds and scored on one evaluation set fixed first.

Materialize ``ablation_grid`` (its points become partitions of ``ablation``), every partition of ``ablation`` (a
backfill in the UI), then ``ablation_report``; ``kiln ablate --preset ablation-demo`` does all three. A mixture sweep
(``mixture.groups`` set) is the same three assets: random mixtures as points, then the report fits the regression and
trains the predicted best mixture against the default one.
"""


import base64
import dataclasses
import math
import time
from pathlib import Path
from typing import Annotated, Any

from dagster import AssetExecutionContext, DynamicPartitionsDefinition, Failure, MetadataValue, Output, asset
from pydantic import Field

from assets._common import (add_new_partitions, asset_output, failing_on_config_errors, log_child_run, md_table,
                            point_records)
from assets._config import KilnConfig
from assets.collect import Clean
from assets.evals import prepared_benchmarks
from assets.scaling import SweptField
from assets.tokens import TOKENIZER_HOLDOUT_PERMILLE  # a point's own BPE, as the shared one, never trains on these
from assets.training import Batch, Hardware, ModelOverrides, Optim
from kiln.common.config import ConfigError, Domain
from kiln.common.files import atomic_write_json, stable_hash
from kiln.scaling import ablation as kabl
from kiln.scaling import mixture as kmix
from kiln.scaling.sweep import Point, Swept
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource

ABLATION_POINTS = "ablation_points"  # the dynamic partitions set: one key per point of the grid ablation_grid expanded
ablation_partitions = DynamicPartitionsDefinition(name=ABLATION_POINTS)


class MixtureConfig(KilnConfig):
    groups: list[str] = Field(default=[], description="Source globs, one per group of the mixture (e.g. owt*, wikipedia*, web-samples, abs-guide, fortunes*); every source must match one. Empty: not a mixture sweep.")
    samples: Annotated[int, Domain(3)] = Field(default=10, description="Random mixtures trained as proxies (the regression's data).")
    alpha: Annotated[float, Domain(0, low_open=True)] = Field(default=1.0, description="Dirichlet concentration the mixtures are drawn from (1: uniform over the simplex).")
    seed: Annotated[int, Domain(0)] = Field(default=0, description="Seed of the draws (the same mixtures for the same seed).")
    seeds_per_mixture: Annotated[int, Domain(1)] = Field(default=1, description="Proxy seeds per random mixture (the first of `seeds`); the baseline and the verification train every seed.")
    candidates: Annotated[int, Domain(1)] = Field(default=100_000, description="Candidate mixtures the fitted regression scores.")
    top: Annotated[int, Domain(1)] = Field(default=100, description="The predicted best mixture is the mean of this many best-predicted candidates (RegMix: 100).")


class AblationGridConfig(KilnConfig):
    fields: list[SweptField] = Field(default=[], description="The data fields changed and their values: clean.<key> (clean.olmo2.enabled, clean.min_words, clean.minhash.enabled, clean.quality_model.min_score ...), mix.<source glob> (a weight) or tokenizer.vocab_size.")
    mode: str = Field(default="one_at_a_time", description="one_at_a_time: one point per value, the rest as the baseline has it; grid: every combination; random: `samples` seeded draws.")
    samples: Annotated[int, Domain(1)] = Field(default=8, description="Random mode: how many points to draw.")
    seed: Annotated[int, Domain(0)] = Field(default=0, description="Random mode: the draw's seed.")
    mixture: MixtureConfig = Field(default_factory=MixtureConfig, description="A mixture sweep instead of fields: random mixtures of these groups, a regression, the predicted best verified.")
    clean: Clean = Field(default_factory=Clean, description="The baseline's clean config (every point changes it); set it as clean_corpus's is to ablate the pipeline's own rules.")
    eval_permille: Annotated[int, Domain(1, TOKENIZER_HOLDOUT_PERMILLE)] = Field(default=50, description="The evaluation documents: the baseline corpus's documents whose id hashes below this per thousand (inside the tokenizer's held-out 5%).")
    eval_mb: Annotated[float, Domain(0, low_open=True)] = Field(default=0.25, description="At most this many MB of evaluation text.")
    model_preset: str = Field(default="tiny", description="The proxy's named size (kiln.model.config.MODEL_PRESETS of its family); `model` overrides its fields.")
    model: ModelOverrides = Field(default=ModelOverrides(family="llama", n_layer=4, n_embd=128, block_size=256), description="The proxy's family and the fields overriding its named size (the default: 4 layers of 128, about 1.3M parameters with a 4,096-token vocabulary).")
    batch: Batch = Field(default=Batch(seq_len=256, global_batch=8), description="The proxy's sequence length and global batch (max_steps is ignored: `tokens` sets the steps).")
    hardware: Hardware = Field(default_factory=Hardware, description="Where the proxies train: device, processes.")
    optim: Optim = Field(default_factory=Optim, description="The proxy's optimizer (the pretraining recipe's by default).")
    tokens: Annotated[int, Domain(1)] = Field(default=400_000, description="Tokens every point trains on; a point with fewer repeats its data (its epochs are reported).")
    seeds: Annotated[list[int], Domain(0)] = Field(default=[0, 1, 2], description="Proxy seeds (initialisation and data order); at least three for an interval worth reading.")
    benchmarks: list[str] = Field(default=[], description="Standard benchmarks (eval_suite's names: arc_easy, hellaswag, piqa, ...) each proxy is also scored on, paired by seed against the baseline; worth it only where the proxy is large enough to rise above chance.")
    benchmark_items: Annotated[int, Domain(2)] = Field(default=200, description="Items per benchmark: a seeded sample, the same for every point and seed.")
    vocab_train_mb: Annotated[float, Domain(0, low_open=True)] = Field(default=20.0, description="tokenizer.vocab_size points: MB of the point's corpus its BPE trains on.")
    split_digits: bool = Field(default=True, description="tokenizer.vocab_size points: split numbers into digits (as the tokenizer asset's default).")


def _sources(raw_documents: dict) -> list[str]:
    return sorted(raw_documents["stats"]["sources"])


def _points(config: AblationGridConfig) -> list[Point]:
    if config.mixture.groups:
        if config.fields:
            raise ConfigError("ablation_grid: set fields or mixture.groups, not both (a mixture sweep varies the mix)")
        mixes = kmix.draw(list(config.mixture.groups), config.mixture.samples, config.mixture.seed, config.mixture.alpha)
        return [Point(kabl.BASELINE, {})] + [Point(f"mixture-{i + 1:02d}", {f"mix.{g}": w for g, w in m.items()})
                                             for i, m in enumerate(mixes)]
    if len(config.seeds) < 2 or len(set(config.seeds)) != len(config.seeds):
        raise ConfigError(f"ablation_grid.seeds: {list(config.seeds)}; give at least two different seeds (three or "
                          "more for an interval worth reading)")
    swept = [Swept(f.field, list(f.values), list(f.choices), f.low, f.high, f.log) for f in config.fields]
    return kabl.expand_data(swept, config.mode, config.samples, config.seed, "ablation_grid")


def proxy_settings(config: AblationGridConfig) -> dict[str, Any]:
    """The proxy's training_plan fields (kiln.plan.memory.plan_from_config's arguments), as plain values."""
    return {"model_preset": config.model_preset, "model": config.model.to_dict(), "batch": config.batch.to_dict(),
            "hardware": config.hardware.to_dict()}


def proxy_plan(settings: dict[str, Any], n_vocab: int) -> dict[str, Any]:
    """The proxy's training plan for a tokenizer of ``n_vocab`` tokens (the planner's, as training_plan makes it)."""
    from kiln.plan.memory import plan_from_config

    made, _, _, hw = plan_from_config(n_vocab, settings["model_preset"], settings["model"], settings["batch"],
                                      settings["hardware"], {}, "ablation_grid")
    return {**made.to_dict(), "hardware": hw.__dict__}


def _grid_value(config: AblationGridConfig, points: list[Point], cleans: dict, eval_info: dict, raw_documents: dict,
                tokenizer: dict, shape: dict, base: dict, sources: list[str]) -> dict[str, Any]:
    """ablation_grid's value: every point with its seeds and clean config, and what every point shares."""
    seeds = list(config.seeds)
    return {
        "points": [{"key": p.key, "values": p.values,
                    "seeds": seeds[:config.mixture.seeds_per_mixture] if p.key.startswith("mixture-") else seeds,
                    "vocab_size": p.values.get("tokenizer.vocab_size"),
                    "clean": dataclasses.asdict(cleans[p.key])} for p in points],
        "mixture": config.mixture.model_dump() if config.mixture.groups else None,
        "eval": eval_info, "raw": {"path": raw_documents["path"], "version": raw_documents["version"]},
        "tokenizer": {"path": tokenizer["path"], "n_vocab": tokenizer["n_vocab"], "version": tokenizer["version"]},
        "tokenizer_settings": {"train_mb": config.vocab_train_mb, "heldout_mb": 2.0, "split_digits": config.split_digits,
                               "holdout_permille": TOKENIZER_HOLDOUT_PERMILLE},
        "proxy": proxy_settings(config), "optim": config.optim.to_dict(), "tokens": config.tokens, "seeds": seeds,
        **({"benchmarks": list(config.benchmarks), "benchmark_items": config.benchmark_items} if config.benchmarks else {}),
        "shape": {k: shape[k] for k in ("params", "tokens_per_step", "seq_len", "micro_batch")},
        "base_clean": base, "sources": sources,
    }


@asset(code_version="1", group_name="decisions")
def ablation_grid(context: AssetExecutionContext, config: AblationGridConfig, raw_documents: dict, tokenizer: dict,
                  storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """The points of a data ablation (rules, thresholds, dedup, the quality classifier, the source mixture or the vocabulary, each checked before anything trains), registered as partitions of `ablation`; and the evaluation set, fixed here: documents of the baseline's clean corpus no point trains on."""
    root = storage.path("ablation")
    sources = _sources(raw_documents)
    with failing_on_config_errors():
        points = _points(config)
        base = config.clean.to_dict(changed_only=True)
        cleans = {p.key: kabl.point_clean(base, p.values, sources, f"ablation_grid point {p.key}") for p in points}
        shape = proxy_plan(proxy_settings(config), tokenizer["n_vocab"])
        if tokenizer.get("kind") == "pretrained" and any(f.field == "tokenizer.vocab_size" for f in config.fields):
            raise ConfigError("ablation_grid: tokenizer.vocab_size with a pretrained model's tokenizer: the proxies "
                              "would not share its vocabulary; drop the field or the pretrained model")
    # a bad benchmark name or a missing package: one line, before anything is cleaned or trained
    prepared_benchmarks(list(config.benchmarks), config.benchmark_items, kabl.BENCHMARK_SEED, storage,
                        where="ablation_grid.benchmarks")
    baseline = kabl.clean_point(raw_documents, cleans[kabl.BASELINE], root, storage.path("clean_shards"), context.log.info)
    if "empty" in baseline:
        raise Failure(f"ablation_grid: the baseline clean config keeps no document: {baseline['empty']}")
    docs = kabl.choose_eval_docs(baseline["path"], config.eval_permille, config.eval_mb)
    eval_info = kabl.write_eval_docs(docs, root / "evalsets" / f"{baseline['content'][:16]}-{config.eval_permille}-{config.eval_mb:g}.parquet")
    value = _grid_value(config, points, cleans, eval_info, raw_documents, tokenizer, shape, base, sources)
    value["version"] = stable_hash(value)[:16]
    new = add_new_partitions(context.instance, ABLATION_POINTS, [p.key for p in points])
    context.log.info(f"ablation_grid: {len(points)} points ({len(new)} new partitions of ablation); evaluation set "
                     f"{eval_info['documents']} documents, {eval_info['bytes'] / 1e6:.2f} MB")
    with asset_output(context, mlflow, params={"points": len(points), "mode": config.mode,
                                              "seeds": len(config.seeds), "tokens": config.tokens}) as out:
        return out.result(value, grid_metadata(value, shape, len(new)), version=value["version"])


def grid_metadata(grid: dict[str, Any], shape: dict[str, Any], new_partitions: int) -> dict[str, Any]:
    """What the ablation_grid asset shows: its points and their changes, the proxy, the evaluation set."""
    steps = math.ceil(grid["tokens"] / shape["tokens_per_step"])
    rows = [{"point": p["key"], "changes": ", ".join(f"{k}={v}" for k, v in p["values"].items()) or "-",
             "seeds": len(p["seeds"])} for p in grid["points"]]
    return {
        "points": len(grid["points"]), "new_partitions": new_partitions, "grid": md_table(rows),
        "proxy": f"{shape['params']:,} parameters, {steps} steps of {shape['tokens_per_step']:,} tokens "
                 f"({grid['tokens']:,} tokens) per seed, seeds {grid['seeds']}",
        "eval_documents": grid["eval"]["documents"], "eval_bytes": grid["eval"]["bytes"],
        "eval_set": MetadataValue.path(grid["eval"]["path"]),
        "next": "materialize every partition of ablation (kiln ablate --preset P runs them), then ablation_report",
    }


def point_file(storage: KilnStorageResource, grid_version: str, key: str) -> Path:
    return storage.path("ablation", "points", grid_version) / (stable_hash(key)[:16] + ".json")


def point_runner(context, grid: dict, storage: KilnStorageResource, torchrun: TorchrunResource):
    """run(point dict) -> the point's record: kiln.scaling.ablation.run_point with the grid's inputs and torchrun."""
    from kiln.clean.config import CleanConfig

    proxy = kabl.Proxy(lambda n: proxy_plan(grid["proxy"], n), grid["optim"], grid["tokens"], grid["seeds"],
                       grid.get("benchmarks", []), grid.get("benchmark_items", 200), str(storage.cache_dir))

    hw = proxy_plan(grid["proxy"], grid["tokenizer"]["n_vocab"])["hardware"]  # every point's (the vocabulary aside)

    def launch(job: dict, run_dir: Path, name: str) -> dict:
        context.log.info(f"ablation: training {name} in {run_dir}")
        return torchrun.launch(context, job, hw["nproc_per_node"], hw["device"])

    def run(p: dict) -> dict:
        point = kabl.PointPlan(p["key"], p["values"], CleanConfig.from_dict(p["clean"], f"ablation point {p['key']}"),
                               p.get("vocab_size"), p["seeds"])
        return kabl.run_point(point, grid["raw"], grid["tokenizer"], grid["tokenizer_settings"], grid["eval"], proxy,
                              storage.path("ablation"), storage.path("clean_shards"), launch, context.log.info)
    return run


@asset(partitions_def=ablation_partitions, code_version="1", group_name="decisions")
def ablation(context: AssetExecutionContext, ablation_grid: dict, storage: KilnStorageResource,
             torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """One point of the ablation (this partition's key names its change): its clean corpus, training tokens and one proxy per seed, each stage keyed by content and reused; documents and tokens kept, epochs, and each seed's bits per byte on the fixed evaluation set."""
    key = context.partition_key
    points = {p["key"]: p for p in ablation_grid["points"]}
    if key not in points:
        raise Failure(f"ablation: partition {key!r} is not a point of the current grid ({len(points)} points, version "
                      f"{ablation_grid['version']}); rematerialize ablation_grid with the ablation that has it, or pick "
                      f"one of {', '.join(sorted(points)[:8])}")
    with failing_on_config_errors():
        record = point_runner(context, ablation_grid, storage, torchrun)(points[key])
    atomic_write_json(point_file(storage, ablation_grid["version"], key), record)
    meta: dict[str, Any] = {"changes": ", ".join(f"{k}={v}" for k, v in points[key]["values"].items()) or "none (baseline)",
                            "wall_s": record["wall_s"]}
    if record.get("empty"):
        meta["empty"] = record["empty"]
    else:
        meta.update({"kept_documents": record["kept_docs"], "train_tokens": record["train_tokens"],
                     "epochs": record["epochs"], "eval_overlap_removed": record["eval_overlap_removed"],
                     "seeds": md_table([{k: r[k] for k in ("seed", "bpb", "val_loss", "wall_s", "reused")}
                                        for r in record["runs"]]),
                     "mean_bpb": sum(r["bpb"] for r in record["runs"]) / len(record["runs"]),
                     "reused": record["reused"]})
    return Output({"key": key, "grid": ablation_grid["version"], "file": str(point_file(storage, ablation_grid["version"], key))},
                  metadata=meta)


def _records(grid: dict, storage: KilnStorageResource) -> list[dict]:
    return point_records({p["key"]: point_file(storage, grid["version"], p["key"]) for p in grid["points"]},
                         "ablation_report", "ablation", "kiln ablate --preset P")


def verify_mixture(context, grid: dict, records: list[dict], storage: KilnStorageResource,
                   torchrun: TorchrunResource) -> dict[str, Any]:
    """The regression of bits per byte on the random mixtures' shares, the predicted best mixture, and its
    verification: the best mixture trained with every seed, compared with the baseline (the default mixture)."""
    mix = grid["mixture"]
    trained = [r for r in records if r["key"].startswith("mixture-") and not r.get("empty")]
    shares = [{g: r["values"][f"mix.{g}"] for g in mix["groups"]} for r in trained]
    bpb = [sum(x["bpb"] for x in r["runs"]) / len(r["runs"]) for r in trained]
    model = kmix.fit(shares, bpb)
    chosen = kmix.best(model, mix["seed"] + 1, mix["alpha"], mix["candidates"], mix["top"])
    values = {f"mix.{g}": w for g, w in chosen["shares"].items()}
    with failing_on_config_errors():
        cfg = kabl.point_clean(grid["base_clean"], values, grid["sources"], "ablation_report: the predicted best mixture")
    from kiln.common.config import to_dict

    point = {"key": "predicted-best", "values": values, "seeds": grid["seeds"], "vocab_size": None, "clean": to_dict(cfg)}
    context.log.info(f"ablation_report: regression over {len(trained)} mixtures (leave-one-out MAE {model['loo_mae']:.4f} "
                     f"vs {model['loo_mae_mean']:.4f} predicting the mean); verifying {chosen['shares']}")
    best = point_runner(context, grid, storage, torchrun)(point)
    base = next(r for r in records if r["key"] == kabl.BASELINE)
    verdict = kabl.compare({r["seed"]: r["bpb"] for r in base["runs"]}, {r["seed"]: r["bpb"] for r in best["runs"]})
    return {"fit": model, "best": chosen, "record": best, "verification": verdict,
            "trained": [{"point": r["key"], **s, "bpb": y} for r, s, y in zip(trained, shares, bpb)]}


def _fmt(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) and math.isfinite(v) else v


def _changes_md(samples: dict[str, dict]) -> str:
    """What each point's change removed and let in, with samples, as markdown."""
    return "\n\n".join(
        f"**{k}**: removed {s['removed_count']} documents the baseline keeps, let in {s['let_in_count']}\n\n"
        + "\n".join(f"- removed `{x['id']}` ({x['reason']}): {x['text'][:200]}" for x in s["removed"])
        + ("\n" if s["removed"] else "") + "\n".join(f"- let in `{x['id']}` (baseline: {x['reason']}): {x['text'][:200]}"
                                                     for x in s["let_in"]) for k, s in samples.items())


def _report_tables(rows: list[dict], mixture: dict | None) -> dict[str, Any]:
    """ablation_report's tables: the points, their benchmark scores where scored, the mixture's fit and verification."""
    cols = ["point", "kept_docs", "train_tokens", "epochs", "bpb", "diff", "low", "high", "base_sd", "point_sd",
            "verdict"]
    meta: dict[str, Any] = {"results": md_table([{c: _fmt(r.get(c)) for c in cols} for r in rows])}
    bench = [{"point": r["point"], "benchmark": n, "score": _fmt(b["score"]), "chance": _fmt(b["chance"]),
              "diff": _fmt(b["diff"]), "low": _fmt(b["low"]), "high": _fmt(b["high"]), "verdict": b["verdict"]}
             for r in rows for n, b in (r.get("benchmarks") or {}).items()]
    if bench:
        meta["benchmarks"] = md_table(bench)
    if mixture:
        fit, ver = mixture["fit"], mixture["verification"]
        meta.update({"mixture_fit": md_table([{"n": fit["n"], "r2": _fmt(fit["r2"]), "loo_mae": _fmt(fit["loo_mae"]),
                                               "loo_mae_predicting_mean": _fmt(fit["loo_mae_mean"])}]),
                     "mixture_trained": md_table([{k: _fmt(v) for k, v in r.items()} for r in mixture["trained"]]),
                     "predicted_best": MetadataValue.json(mixture["best"]),
                     "verification": md_table([{k: _fmt(ver.get(k)) for k in ("diff", "low", "high", "base_sd",
                                                                              "point_sd", "verdict")}])})
    return meta


def _differences_png(rows: list[dict], mixture: dict | None) -> bytes:
    from kiln.common.plots import interval_plot_png

    scored = [(r["point"], r["diff"], r.get("low"), r.get("high")) for r in rows
              if r["point"] != kabl.BASELINE and "diff" in r]
    if mixture:
        ver = mixture["verification"]
        scored.append(("predicted-best mixture", ver["diff"], ver["low"], ver["high"]))
    return interval_plot_png(scored, "held-out bits per byte: point minus baseline (95% interval over seeds)",
                             "Δ bits per byte")


@asset(code_version="1", group_name="decisions", deps=[ablation])
def ablation_report(context: AssetExecutionContext, ablation_grid: dict, storage: KilnStorageResource,
                    torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """Every point of the ablation beside the baseline: documents and tokens kept, what the change removed or let in, the difference in held-out bits per byte with its 95% interval over seeds, and the verdict (helps, hurts, within noise); a plot; an MLflow parent run with a child per point and seed. A mixture sweep adds the regression, the predicted best mixture and its verification against the default."""
    start = time.perf_counter()
    records = _records(ablation_grid, storage)
    with failing_on_config_errors():
        rows = kabl.summarize(records)
    by_key = {r["key"]: r for r in records}
    samples = {r["point"]: kabl.changes(by_key[kabl.BASELINE], by_key[r["point"]]) for r in rows
               if r["point"] != kabl.BASELINE and not by_key[r["point"]].get("empty")}
    mixture = verify_mixture(context, ablation_grid, records, storage, torchrun) if ablation_grid["mixture"] else None
    value = {"rows": rows, "grid": ablation_grid["version"], "samples": samples, "mixture": mixture,
             "reused_points": sum(bool(r.get("reused")) for r in records), "points": len(records),
             "proxy": {**ablation_grid["shape"], "tokens": ablation_grid["tokens"], "seeds": ablation_grid["seeds"],
                       "model": ablation_grid["proxy"]["model"], "model_preset": ablation_grid["proxy"]["model_preset"]},
             "eval": {k: ablation_grid["eval"][k] for k in ("documents", "bytes", "sha256")}}
    value["version"] = stable_hash({"rows": rows, "mixture": mixture and mixture["verification"]})[:16]
    with asset_output(context, mlflow, params={"points": len(records), "grid": ablation_grid["version"]},
                      parent=storage.path("ablation_report")) as out:
        for rec in records + ([mixture["record"]] if mixture else []):
            for run in rec.get("runs", []):  # a child per point and seed under this asset's run
                log_child_run(out, f"{rec['key']} seed {run['seed']}", "ablation_point",
                              {**rec["values"], "seed": run["seed"]},
                              {"bpb": run["bpb"], "final_val_loss": run["val_loss"]}, run.get("curve", []))
        png = _differences_png(rows, mixture)
        (out.stage / "differences.png").write_bytes(png)
        out.log_artifact(out.stage / "differences.png")
        out.log_metrics({"points": len(records), "helps": sum(r.get("verdict") == "helps" for r in rows),
                         "hurts": sum(r.get("verdict") == "hurts" for r in rows)})
        meta = {"points": len(records), **_report_tables(rows, mixture),
                "differences": MetadataValue.md(f"![differences](data:image/png;base64,{base64.b64encode(png).decode()})"),
                "changes": MetadataValue.md(_changes_md(samples) or "_no point changed the corpus_"),
                "reused_points": value["reused_points"], "report_s": round(time.perf_counter() - start, 1)}
        atomic_write_json(out.stage / "report.json", value)
        final = out.commit()
        meta["report"] = MetadataValue.path(str(final / "report.json"))
        return out.result({**value, "path": str(final / "report.json")}, meta, version=value["version"])
