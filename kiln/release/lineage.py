"""Release lineage: what made a model, read from a bundle's kiln.json or followed through checkpoints, as a readable tree.

``lineage_tree(read_release_info(dir))`` or ``lineage_tree(checkpoint_lineage(path))`` (``kiln lineage``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.release.bundle import verify_release
from kiln.train.checkpoint import resolve_checkpoint

# kiln.json sections a release can carry (all optional, passed in ``extra``), in the order ``lineage_tree`` shows them.
LINEAGE_SECTIONS: dict[str, str] = {
    "released": "whose weights these are ({asset, stage, chain: the training assets they descend from, in order})",
    "lineage": "data versions of every upstream asset ({asset: version})",
    "pretrained": "released weights the run started from ({stage: {source, sha256, license, model_type, version, ...}})",
    "sources": "the source manifest ([{name, kind, package, version, sha256, license, documents}])",
    "filters": "clean_corpus filter and dedup settings ({setting: value})",
    "corpus": "clean_corpus counts ({input_docs, kept_docs, kept_bytes, dedup_rate, removed: {reason: docs}})",
    "tokens": "token counts ({train, val, ...})",
    "plan": "the training plan (parameters, parallelism, batch, hardware)",
    "training": "training summaries per stage ({stage: {steps, tokens, initial_val_loss, final_val_loss, ...}})",
    "eval": "evaluation scores ({metric: value}) and their chance baselines",
    "post_training": "post-training stages the release's run trained ([{stage, version, ...}]; the released chain "
                     "is in released)",
    "feedback": "AI-judge labels (judged_preferences): the judge {path, kind, sha256, family, params}, the principles "
                "file {path, sha256}, the scoring rule, agreement with the known labels, ties and position bias",
    "configs": "run config of each asset ({asset: config})",
    "mlflow_runs": "MLflow run id of each asset ({asset: run id})",
    "registry": "the registered version, added by kiln lineage for a models:/ reference ({name, version, aliases})",
}


def read_release_info(bundle: str | Path) -> dict[str, Any]:
    """kiln.json of a bundle, after verifying its checksums."""
    bundle = Path(bundle)
    verify_release(bundle)
    return {"release": str(bundle), **json.loads((bundle / "kiln.json").read_text())}


def checkpoint_lineage(path: str | Path) -> dict[str, Any]:
    """What a checkpoint records about its making: its job (data files, tokenizer, init checkpoint, MLflow run),
    followed through ``init_from`` to the checkpoint it was fine-tuned from."""
    from kiln.train.checkpoint import verify_checkpoint
    from kiln.tokens.tokenizer import encoding_fingerprint, load_encoding

    ckpt = resolve_checkpoint(path)
    meta = verify_checkpoint(ckpt)
    enc = load_encoding(ckpt / "tokenizer.json")
    job_path = ckpt.parent.parent / "job.json"  # <run folder>/checkpoints/step_N
    job = json.loads(job_path.read_text()) if job_path.is_file() else {}
    task = meta.get("task") or job.get("task")
    info: dict[str, Any] = {
        "checkpoint": str(ckpt), "step": meta["step"], "task": task, "val_loss": meta.get("val_loss"),
        "model": meta["model"], "tokenizer": {"name": enc.name, "n_vocab": enc.n_vocab, "fingerprint": encoding_fingerprint(enc)},
    }
    if meta.get("pretrained"):  # a checkpoint imported from a Hugging Face folder (kiln.pretrained)
        info["pretrained"] = {k: meta["pretrained"].get(k) for k in ("source", "sha256", "license", "model_type")}
    if job:
        info["job"] = {k: job.get(k) for k in ("train_files", "val_files", "tokenizer", "seq_len", "micro_batch",
                                               "grad_accum", "max_steps", "seed", "optim") if k in job}
        info["job"]["file"] = str(job_path)
        if job.get("mlflow_run_id"):
            info["mlflow_runs"] = {task or "train": job["mlflow_run_id"]}
        if job.get("init_from"):
            try:
                info["init_from"] = checkpoint_lineage(job["init_from"])
            except Exception as e:  # the parent run folder was cleaned away: say so instead of failing
                info["init_from"] = {"checkpoint": job["init_from"], "error": str(e)}
    return info


def _scalar(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, default=str)
    return str(v)


def _tree(value: Any, indent: str, lines: list[str], max_items: int = 12) -> None:
    """Append ``value`` as indented ``key: value`` lines; lists of records become one line per record."""
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value)) if isinstance(value, list) else None
    if items is None:
        lines.append(f"{indent}{_scalar(value)}")
        return
    for k, v in items[:max_items] if max_items else items:
        if isinstance(value, list) and isinstance(v, dict):
            head = next((h for h in ("name", "stage", "task") if h in v), None)
            rest = ", ".join(f"{kk}={_scalar(x)}" for kk, x in v.items() if kk != head)
            lines.append(f"{indent}- {v[head] if head else k}: {rest}")
        elif isinstance(value, list):
            lines.append(f"{indent}- {_scalar(v)}")
        elif isinstance(v, dict) and v or isinstance(v, list) and any(isinstance(x, dict) for x in v):
            lines.append(f"{indent}{k}:")
            _tree(v, indent + "  ", lines, max_items)
        else:
            lines.append(f"{indent}{k}: {_scalar(v)}")
    if max_items and len(items) > max_items:
        lines.append(f"{indent}... {len(items) - max_items} more (--full shows all)")


def lineage_tree(info: dict[str, Any], full: bool = False) -> str:
    """A readable tree of a release's (or checkpoint's) lineage: what made the model, section by section."""
    lines: list[str] = []
    limit = 0 if full else 12
    if "release" in info:
        lines.append(" ".join(str(x) for x in ("release", info.get("name"), info["release"]) if x))
        lines.append(f"  from checkpoint {info.get('source_checkpoint')} (step {info.get('step')}, task {info.get('task')})")
    else:
        lines.append(f"checkpoint {info['checkpoint']} (step {info.get('step')}, task {info.get('task')}, "
                     f"val loss {_scalar(info.get('val_loss'))})")
    m = info.get("model") or {}
    if m:
        lines.append(f"  model: {m.get('n_layer')} layers x {m.get('n_head')} heads x width {m.get('n_embd')}, "
                     f"context {m.get('block_size')}, vocabulary {m.get('vocab_size')}")
    t = info.get("tokenizer") or {}
    if t:
        lines.append(f"  tokenizer: {t.get('name')} ({t.get('n_vocab')} tokens, fingerprint {str(t.get('fingerprint'))[:16]})")
    shown = {"release", "name", "source_checkpoint", "step", "task", "model", "tokenizer", "checkpoint", "val_loss",
             "format", "checkpoint_val_loss", "init_from"}
    for key in [*LINEAGE_SECTIONS, *(k for k in info if k not in LINEAGE_SECTIONS and k not in shown)]:
        if key in shown or info.get(key) in (None, {}, []):
            continue
        lines.append(f"  {key}:")
        _tree(info[key], "    ", lines, limit)
    if "init_from" in info:
        lines.append("  fine-tuned from:")
        lines += ["    " + line for line in lineage_tree(info["init_from"], full).splitlines()]
    return "\n".join(lines) + "\n"


# ---- what release_bundle records --------------------------------------------------------------------------

# Upstream assets whose data versions a release records, in order (the training plan is recorded as "plan").
LINEAGE_ASSETS = ("raw_documents", "clean_corpus", "tokenizer", "token_shards", "base_model", "eval_scores",
                  "instruction_data", "preference_data", "sft_model", "dpo_model", "rl_model")
POST_TRAINING = (("sft", "sft_model"), ("dpo", "dpo_model"), ("rl", "rl_model"))  # (stage, asset), in order
RLHF = (("reward", "reward_model"), ("ppo", "ppo_model"))  # the chain a PPO release adds (release_bundle.stage)
TRAINED = ("base_model", *(a for _, a in POST_TRAINING), *(a for _, a in RLHF))  # assets with a training run
# The training assets each releasable stage's weights descend from, in order (the reward model scored PPO's samples).
RELEASED_CHAINS = {"rl_model": ("base_model", "sft_model", "dpo_model", "rl_model"),
                   "ppo_model": ("base_model", "sft_model", "reward_model", "ppo_model")}
STAGE_KEYS = ("version", "steps", "tokens", "initial_val_loss", "final_val_loss", "wall_s", "checkpoint", "pretrained")
PLAN_KEYS = ("params", "parallelism", "world_size", "micro_batch", "grad_accum", "tokens_per_step", "model", "hardware")


# Recorded when the run materialized them (release_bundle gets None otherwise; it is given the RLHF chain only
# when it releases it).
OPTIONAL_LINEAGE = ("judged_preferences", "reward_model", "ppo_model")
FEEDBACK_KEYS = ("version", "judge", "principles", "rule")


def lineage_versions(up: dict[str, dict[str, Any]]) -> dict[str, str]:
    """{asset: data version} of every asset in LINEAGE_ASSETS, and of those in OPTIONAL_LINEAGE that ``up`` holds."""
    return {k: up[k]["version"] for k in (*LINEAGE_ASSETS, *(k for k in OPTIONAL_LINEAGE if up.get(k)))}


def released_section(up: dict[str, dict[str, Any]], released: str) -> dict[str, Any]:
    """{asset, stage, chain} of the released weights; the chain names only training assets ``up`` holds."""
    stage = dict((a, s) for s, a in (*POST_TRAINING, *RLHF))[released]
    return {"asset": released, "stage": stage, "chain": [a for a in RELEASED_CHAINS[released] if up.get(a)]}


def feedback_section(judged: dict[str, Any]) -> dict[str, Any]:
    """What a release records of judged_preferences: the judge's identity, the principles' sha256, the rule, and the
    judge's agreement with the known labels, its ties and position bias."""
    s = judged["summary"]
    return {**{k: judged[k] for k in FEEDBACK_KEYS}, "agreement": s["agreement"], "position_bias": s["position_bias"],
            "pairs_labelled": s["pairs_labelled"], "ties": s["ties"]}


def _stage(out: dict[str, Any]) -> dict[str, Any]:
    return {k: out[k] for k in STAGE_KEYS if k in out}


def pretrained_stages(up: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{asset: the released weights it started from} for the TRAINED assets that started from imported weights."""
    return {k: up[k]["pretrained"] for k in TRAINED if up.get(k) and up[k].get("pretrained")}


def release_sections(name: str, license: str, up: dict[str, dict[str, Any]], scores: dict[str, float],
                     configs: dict[str, Any], released: str = "rl_model") -> dict[str, Any]:
    """The LINEAGE_SECTIONS of a release's kiln.json, from the upstream outputs ``up`` (as ``lineage_versions``)
    and the flat evaluation ``scores``; configs: {asset: its run config}; released: the asset whose weights these
    are (a RELEASED_CHAINS key). A run that started from released weights also gets a ``pretrained`` section, and
    one whose judged_preferences ran a ``feedback`` section."""
    raw, rep, plan = up["raw_documents"], up["clean_corpus"]["report"], up["training_plan"]
    pretrained = pretrained_stages(up)
    return {
        **({"pretrained": pretrained} if pretrained else {}),
        **({"feedback": feedback_section(up["judged_preferences"])} if up.get("judged_preferences") else {}),
        "name": name, "released": released_section(up, released), "lineage": lineage_versions(up),
        "mlflow_runs": {k: up[k]["mlflow_run_id"] for k in TRAINED if up.get(k)},
        "license": license,
        "sources": [{**s, "documents": raw["stats"]["sources"].get(s["name"], {}).get("documents")} for s in raw["sources"]],
        "filters": rep["config"],
        "corpus": {**{k: rep[k] for k in ("input_docs", "kept_docs", "kept_bytes", "dedup_rate")},
                   "removed": {r: v["docs"] for r, v in rep["reasons"].items()}},
        "tokens": {s: up["token_shards"]["totals"][s]["tokens"] for s in ("train", "val")},
        "plan": {k: plan[k] for k in PLAN_KEYS if k in plan},
        "training": {"base_model": _stage(up["base_model"])},
        "eval": {**scores, "uniform_loss": up["eval_scores"]["uniform_loss"]},
        "post_training": [{"stage": stage, **_stage(up[asset])} for stage, asset in (*POST_TRAINING, *RLHF) if up.get(asset)],
        "configs": configs,
    }
