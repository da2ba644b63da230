"""MLflow model registry for release bundles: a model version per bundle, an alias, scores and lineage as version tags.

Use: ``register_unless_regressed(uri, "kiln-demo", bundle, scores, lineage, run_id)``; ``kiln lineage models:/NAME@ALIAS``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.release.bundle import verify_release
from kiln.common.files import sha256_file

TAG_SCORES = "kiln.scores"  # JSON {metric: value}: the exact scores (per-metric tags below are for the UI)
TAG_SCORE = "kiln.score."  # + metric name with characters MLflow refuses replaced by "_"
TAG_LINEAGE = "kiln.lineage."  # + asset name -> data version
TAG_BUNDLE = "kiln.bundle"  # the bundle folder the version was registered from
TAG_DIGEST = "kiln.bundle_sha256"  # sha256 of the bundle's SHA256SUMS: identifies its content
TAG_PREVIOUS = "kiln.previous_version"  # the version the alias pointed to before this one ("" for the first)
TAG_ALIAS = "kiln.alias"  # the alias this version was compared against (and set to, unless it regressed)
# Metrics where a smaller value is better; every other compared metric is better when larger.
LOWER_IS_BETTER = re.compile(r"(loss|bits_per_byte|bpb|perplexity|ppl|word_perplexity|byte_perplexity)")
# Metrics that describe a score rather than measure the model: never compared.
NOT_COMPARED = re.compile(r"(stderr|chance|baseline|items|uniform)")


@dataclass
class ReleaseVersion:
    name: str  # registered model name
    version: str  # its model version number, as MLflow returns it (a string)
    source: str  # where the version's files are: the run's artifact URI, or the bundle folder as a file:// URI
    run_id: str | None  # the MLflow run that produced the release
    bundle: str  # the bundle folder it was registered from
    digest: str  # sha256 of the bundle's SHA256SUMS
    previous: str | None  # the version the alias pointed to before (None for the first release)
    scores: dict[str, float] = field(default_factory=dict)  # evaluation scores recorded with the version
    lineage: dict[str, str] = field(default_factory=dict)  # upstream asset -> data version
    aliases: list[str] = field(default_factory=list)  # aliases now pointing at this version


@dataclass
class Regression:
    metric: str  # the score that got worse
    previous: float  # its value in the previous release
    current: float  # its value now
    lower_is_better: bool  # direction used for the comparison

    def __str__(self) -> str:
        better = "lower" if self.lower_is_better else "higher"
        return f"{self.metric}: {self.previous:.6g} -> {self.current:.6g} ({better} is better)"


def _client(tracking_uri: str, registry_uri: str | None = None):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri, registry_uri or tracking_uri)


def bundle_digest(bundle: str | Path) -> str:
    """sha256 of a bundle's SHA256SUMS, which lists every file's sha256: one id for the bundle's content."""
    return sha256_file(Path(bundle) / "SHA256SUMS")


def tag_key(metric: str) -> str:
    """A per-metric tag key MLflow accepts (letters, digits, ``_ . - / : space``)."""
    return TAG_SCORE + re.sub(r"[^\w.\- :/]", "_", metric).strip("/")


def flat_scores(eval_scores: dict[str, Any]) -> dict[str, float]:
    """{metric: value} from an eval_scores output: its top-level numbers and ``tasks.<task>.<metric>`` as ``<task>.<metric>``."""
    out = {k: float(v) for k, v in eval_scores.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
           and k not in ("step",)}
    for task, row in (eval_scores.get("tasks") or {}).items():
        for metric, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{task}.{metric}"] = float(v)
    return out


def _version(mv) -> ReleaseVersion:
    tags = dict(mv.tags or {})
    try:
        aliases = list(mv.aliases or [])
    except AttributeError:
        aliases = []
    return ReleaseVersion(
        name=mv.name, version=str(mv.version), source=mv.source, run_id=mv.run_id or None,
        bundle=tags.get(TAG_BUNDLE, ""), digest=tags.get(TAG_DIGEST, ""), previous=tags.get(TAG_PREVIOUS) or None,
        scores={k: float(v) for k, v in json.loads(tags.get(TAG_SCORES) or "{}").items()},
        lineage={k[len(TAG_LINEAGE):]: v for k, v in tags.items() if k.startswith(TAG_LINEAGE)},
        aliases=aliases,
    )


def _alias_holder(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:  # no such model or alias
        return None


def _ensure_model(client, name: str, description: str | None) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, tags={"kiln.kind": "release"}, description=description)
        except MlflowException:  # created concurrently
            client.get_registered_model(name)


def register_release(tracking_uri: str, name: str, bundle: str | Path, *, scores: dict[str, float] | None = None,
                     lineage: dict[str, str] | None = None, run_id: str | None = None, alias: str = "candidate",
                     set_alias: bool = True, log_artifacts: bool = True, artifact_path: str = "release",
                     description: str | None = None, registry_uri: str | None = None) -> ReleaseVersion:
    """Register a verified release bundle as a version of model ``name`` and (with ``set_alias``) point ``alias`` at it.

    With ``run_id`` and ``log_artifacts`` the bundle is logged to that run and the version's source is the
    artifact URI (the registry entry outlives Kiln's storage folder); otherwise it is the bundle folder.
    Registering the same bundle content again returns the existing version. The version ``alias`` held
    before is recorded, so ``previous_release`` can find it after the alias moved; ``set_alias=False``
    registers a release that must not become the alias (one that regressed) without moving it.
    """
    bundle = Path(bundle).resolve()
    verify_release(bundle)
    client = _client(tracking_uri, registry_uri)
    _ensure_model(client, name, description or "Language models released by Kiln (release_bundle asset).")
    digest = bundle_digest(bundle)
    holder = _alias_holder(client, name, alias)
    found = client.search_model_versions(f"name = '{name}' and tags.`{TAG_DIGEST}` = '{digest}'")
    if found:
        mv = sorted(found, key=lambda v: int(v.version))[0]
    else:
        if run_id and log_artifacts:
            client.log_artifacts(run_id, str(bundle), artifact_path)
            source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
        else:
            source = bundle.as_uri()
        scores = {k: float(v) for k, v in (scores or {}).items()}
        tags = {TAG_BUNDLE: str(bundle), TAG_DIGEST: digest, TAG_SCORES: json.dumps(scores, sort_keys=True),
                TAG_PREVIOUS: str(holder.version) if holder is not None else "", TAG_ALIAS: alias,
                **{tag_key(k): repr(v) for k, v in scores.items()},
                **{TAG_LINEAGE + k: str(v) for k, v in (lineage or {}).items()}}
        mv = client.create_model_version(name, source, run_id=run_id, tags=tags,
                                         description=f"Release bundle {bundle.name} ({digest[:16]})")
    if set_alias:
        client.set_registered_model_alias(name, alias, mv.version)
    return _version(client.get_model_version(name, mv.version))


def get_release(tracking_uri: str, name: str, version_or_alias: str, registry_uri: str | None = None) -> ReleaseVersion:
    """A registered release by version number or alias; raises LookupError naming the model and what is registered."""
    client = _client(tracking_uri, registry_uri)
    mv = (client.get_model_version(name, version_or_alias) if version_or_alias.isdigit()
          else _alias_holder(client, name, version_or_alias))
    if mv is None:
        raise LookupError(f"model {name!r} in {tracking_uri}: no alias {version_or_alias!r}; register a release first "
                          "(the release_bundle asset does) or pass a version number")
    return _version(mv)


def previous_release(tracking_uri: str, name: str, alias: str = "candidate", exclude_version: str | None = None,
                     registry_uri: str | None = None) -> ReleaseVersion | None:
    """The release to compare a new one against: the version ``alias`` points to, or None when there is none.

    Pass ``exclude_version`` (the version just registered, which the alias may already point to) to get the one
    the alias pointed to before it.
    """
    client = _client(tracking_uri, registry_uri)
    mv = _alias_holder(client, name, alias)
    if mv is None:
        return None
    if exclude_version is not None and str(mv.version) == str(exclude_version):
        prev = (mv.tags or {}).get(TAG_PREVIOUS)
        if not prev:
            return None
        mv = client.get_model_version(name, prev)
    return _version(mv)


def compare_scores(current: dict[str, float], previous: dict[str, float], tolerance: float = 0.0) -> list[Regression]:
    """Scores present in both that got worse by more than ``tolerance`` (absolute), loss-like metrics counting down."""
    out = []
    for metric in sorted(set(current) & set(previous)):
        if NOT_COMPARED.search(metric):
            continue
        lower = bool(LOWER_IS_BETTER.search(metric))
        cur, prev = float(current[metric]), float(previous[metric])
        worse = (cur - prev) if lower else (prev - cur)
        if worse > tolerance:
            out.append(Regression(metric, prev, cur, lower))
    return out


def released_scores(released: dict[str, Any]) -> dict[str, float]:
    """The released stage's own held-out measures (its ``after`` means) as ``released.<measure>`` scores, so a
    release is compared with the previous one on the weights it ships, not only on the base model's evaluation."""
    return {f"released.{m}": float(v) for m, v in (released.get("after") or {}).items()}


def stage_regressions(asset: str, start: str, rows: list[dict[str, Any]], tolerance: float = 0.0) -> list[str]:
    """One line per held-out measure the released stage made worse than the weights it started from, beyond noise
    (kiln.posttrain.measures.NOISE_Z paired standard errors) and by more than ``tolerance`` (absolute, as the
    comparison with the previous release: a 0.001-nat change is no regression however small its error), from its
    before_after rows."""
    from kiln.posttrain.measures import NOISE_Z, change_cell, worse_beyond_noise

    return [f"{asset} made {r['measure']} worse than {start}, beyond noise ({NOISE_Z:g} paired SE): "
            f"{r['before']:.4f} -> {r['after']:.4f} ({change_cell(r)})"
            for r in rows if worse_beyond_noise(r) and abs(r["change"]) > tolerance]


def register_unless_regressed(tracking_uri: str, name: str, bundle: str | Path, scores: dict[str, float],
                              lineage: dict[str, str], run_id: str | None, alias: str = "candidate",
                              tolerance: float = 0.0, refusals: list[str] | None = None,
                              ) -> tuple[ReleaseVersion, ReleaseVersion | None, list[str]]:
    """Compare ``scores`` with the release ``alias`` points to, then register the bundle, moving the alias to it
    only when nothing regressed by more than ``tolerance`` and there are no ``refusals`` (reasons found before, e.g.
    ``stage_regressions``). Returns (registered, previous or None, regressions: the refusals, then the scores that
    regressed)."""
    prev = previous_release(tracking_uri, name, alias)
    regressions = list(refusals or []) + ([str(r) for r in compare_scores(scores, prev.scores, tolerance)] if prev else [])
    reg = register_release(tracking_uri, name, bundle, scores=scores, lineage=lineage, run_id=run_id,
                           alias=alias, set_alias=not regressions)
    return reg, prev, regressions
