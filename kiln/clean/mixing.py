"""Source mixing: target shares of the clean corpus per group of sources (web text, books, code, ...), met by
deterministic down-sampling, recorded in the clean report and so in lineage.

Used by kiln.clean.corpus; ``plan_mix({"owt": 3e6, "wiki": 1e6}, MixConfig(weights={"owt": 0.5, "wiki": 0.5}))``.
"""

from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass, field
from typing import Annotated, Any

from kiln.common.config import ConfigError, Domain


@dataclass
class MixConfig:
    # Glob of source names -> weight. Empty: the natural mix (nothing sampled). A source joins the first group
    # whose glob matches it; groups' weights are normalised to shares of the kept bytes.
    weights: Annotated[dict[str, float], Domain(0)] = field(default_factory=dict)
    seed: Annotated[int, Domain(0)] = 0  # which documents a down-sampled group keeps (hash of id and seed)

    def __post_init__(self) -> None:
        if not isinstance(self.weights, dict):
            raise ConfigError(f"clean.mix.weights must be a mapping of source glob -> weight, got {self.weights!r}.")
        for k, v in self.weights.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"clean.mix.weights: '{k}' must map to a number >= 0, got {v!r}.")
        if self.weights and sum(self.weights.values()) <= 0:
            raise ConfigError("clean.mix.weights: at least one weight must be > 0.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"clean.mix.seed must be int, got {self.seed!r}.")


def group_of(source: str, cfg: MixConfig) -> str | None:
    return next((g for g in cfg.weights if fnmatch.fnmatchcase(source, g)), None)


def plan_mix(available: dict[str, int], cfg: MixConfig) -> dict[str, Any]:
    """Sampling rate per source so the groups' byte shares equal their weights, keeping as much as possible.

    ``available``: bytes per source after every filter. Rates are at most 1 (nothing is repeated): the group
    with the least data relative to its weight is kept whole and the others are sampled down to match.
    Returns {"rates": {source: rate}, "groups": {group: {...}}}; with no weights every rate is 1.
    """
    if not cfg.weights:
        return {"rates": {s: 1.0 for s in available}, "groups": {}}
    missing = sorted(s for s in available if group_of(s, cfg) is None)
    if missing:
        raise ConfigError(
            f"clean.mix.weights: source(s) {missing} match no glob in {sorted(cfg.weights)}; give each a weight "
            f"(0 drops a source) or add a catch-all glob such as '*'."
        )
    groups: dict[str, dict[str, Any]] = {}
    for s, b in available.items():
        g = groups.setdefault(group_of(s, cfg), {"sources": [], "available_bytes": 0})  # type: ignore[arg-type]
        g["sources"].append(s)
        g["available_bytes"] += b
    total_w = sum(cfg.weights[g] for g in groups)
    if total_w <= 0:
        raise ConfigError("clean.mix.weights: every source present has weight 0; nothing would be kept.")
    # largest corpus size T with share_g * T <= available_g for every group of positive weight
    feasible = [g["available_bytes"] / (cfg.weights[name] / total_w)
                for name, g in groups.items() if cfg.weights[name] > 0 and g["available_bytes"] > 0]
    total = min(feasible) if feasible else 0.0
    rates: dict[str, float] = {}
    for name, g in groups.items():
        share = cfg.weights[name] / total_w
        rate = min(1.0, share * total / g["available_bytes"]) if g["available_bytes"] else 0.0
        g.update({"weight": cfg.weights[name], "target_share": round(share, 4), "rate": round(rate, 6)})
        for s in g["sources"]:
            rates[s] = rate
    return {"rates": rates, "groups": groups}


def keep_sample(doc_id: str, rate: float, seed: int) -> bool:
    """Deterministic Bernoulli(rate) draw from the document id."""
    if rate >= 1.0:
        return True
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{doc_id}".encode(), digest_size=8).digest(), "little")
    return h / 2**64 < rate
