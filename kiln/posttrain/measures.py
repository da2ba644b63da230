"""The held-out measures every post-training stage is scored on, before and after, on the same fixed items.

``measure_checkpoint(path, heldout_suite(instruction_data, preference_data), "cpu")`` scores one checkpoint;
``comparison_rows(before, after)`` and ``stage_rows(sft, dpo, rl)`` make the tables assets and model cards show.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.common.files import stable_hash
from kiln.model.gpt import GPT
from kiln.posttrain.instructions import arithmetic_reward
from kiln.posttrain.logprobs import encode_rows, score_responses, token_logps
from kiln.posttrain.sampling import complete, decode_completion
from kiln.posttrain.sft import IGNORE, read_pairs
from kiln.train.checkpoint import load_for_inference

MEASURES = {  # name -> what it is, shown beside the numbers
    "arithmetic_exact_match": "held-out arithmetic answered exactly (greedy; the RL task reward)",
    "preference_accuracy": "held-out preference pairs whose correct response is more likely than the wrong one",
    "preference_margin": "mean log p(correct) - log p(wrong) on held-out preference pairs (nats)",
    "response_loss": "masked response loss on held-out instruction pairs (nats/token)",
    "response_token_accuracy": "held-out response tokens predicted exactly (teacher forcing)",
}


@torch.no_grad()
def measure(model: GPT, enc, arithmetic: list[dict], preferences: list[dict], instructions: list[dict],
            max_new_tokens: int = 16, device: torch.device | str = "cpu") -> dict[str, float]:
    """Every before/after measure on fixed held-out items (the same lists for every stage give comparable rows)."""
    model.eval()
    seq_len = model.config.block_size - 1
    res: dict[str, float] = {}
    if arithmetic:
        outs = complete(model, enc, [a["prompt"] for a in arithmetic], max_new_tokens, device=device)
        res["arithmetic_exact_match"] = float(np.mean([arithmetic_reward(decode_completion(enc, o[0]), a["answer"])
                                                       for o, a in zip(outs, arithmetic)]))
    if preferences:
        prompts = [p["prompt"] for p in preferences]
        chosen, _ = score_responses(model, enc, prompts, [p["chosen"] for p in preferences], seq_len, device=device)
        rejected, _ = score_responses(model, enc, prompts, [p["rejected"] for p in preferences], seq_len, device=device)
        diff = np.array(chosen) - np.array(rejected)
        res["preference_accuracy"] = float(np.mean(diff > 0))
        res["preference_margin"] = float(np.mean(diff))
    if instructions:
        nll = correct = count = 0.0
        for i in range(0, len(instructions), 16):
            chunk = instructions[i : i + 16]
            x, y = encode_rows(enc, [c["prompt"] for c in chunk], [c["response"] for c in chunk], seq_len)
            x, y = x.to(device), y.to(device)
            logits = model(x)  # (B, T, V)
            keep = y != IGNORE
            nll += float(-token_logps(logits, y)[keep].sum())
            correct += float((logits.argmax(-1) == y)[keep].sum())
            count += float(keep.sum())
        res["response_loss"] = nll / max(count, 1)
        res["response_token_accuracy"] = correct / max(count, 1)
    return res


def heldout_suite(instruction_data: dict, preference_data: dict) -> dict[str, list[dict]]:
    """The fixed held-out items every stage is measured on (the same lists before and after, for every stage)."""
    n = instruction_data["eval_items"]
    val = read_pairs(instruction_data["path"], "val")
    return {"arithmetic": [p for p in val if p["kind"] == "arithmetic"][:n], "instructions": val[:n],
            "preferences": read_pairs(preference_data["path"], "val")[:n]}


def suite_key(suite: dict[str, list[dict]]) -> str:
    return stable_hash(suite)[:16]


def measure_checkpoint(checkpoint: str, suite: dict[str, list[dict]], device: str) -> dict[str, float]:
    """The held-out measures of one checkpoint (on the GPU when the plan trains on one)."""
    dev = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    model, enc, _ = load_for_inference(checkpoint, dev)
    threads = torch.get_num_threads()
    if dev == "cpu":  # small latency-bound batches: one thread avoids synchronisation that costs more than it saves
        torch.set_num_threads(1)
    try:
        return measure(model, enc, suite["arithmetic"], suite["preferences"], suite["instructions"], device=dev)
    finally:
        torch.set_num_threads(threads)


def measure_before(init: dict, suite: dict[str, list[dict]], device: str) -> dict[str, float]:
    """The starting model's measures: the previous stage's "after" when it was taken on this same suite."""
    if init.get("suite_key") == suite_key(suite) and init.get("after"):
        return dict(init["after"])
    return measure_checkpoint(init["checkpoint"], suite, device)


def comparison_rows(before: dict[str, float], after: dict[str, float]) -> list[dict[str, Any]]:
    """[{measure, before, after, change}] in MEASURES order, for metadata tables and model cards."""
    return [{"measure": m, "before": before[m], "after": after[m], "change": after[m] - before[m]}
            for m in MEASURES if m in before and m in after]


def comparison_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The comparison rows with what each measure is, as the before_after metadata table shows them."""
    return [{**r, "what": MEASURES[r["measure"]]} for r in rows]


def comparison_line(rows: list[dict[str, Any]]) -> str:
    return "before -> after: " + "; ".join(f"{r['measure']} {r['before']:.3f} -> {r['after']:.3f}" for r in rows)


def log_comparison(before: dict[str, float], after: dict[str, float], tracking_uri: str, run_id: str,
                   step: int) -> list[dict[str, Any]]:
    """The side-by-side rows, logged to the stage's MLflow run as before.<m> / after.<m> and a JSON table."""
    from kiln.common.metrics import MetricLogger

    rows = comparison_rows(before, after)
    tracker = MetricLogger(tracking_uri, run_id)
    tracker.log({**{f"before.{k}": v for k, v in before.items()}, **{f"after.{k}": v for k, v in after.items()}}, step)
    tracker.flush()
    if tracker.client is not None:
        tracker.client.log_dict(run_id, {"rows": rows, "measures": MEASURES}, "before_after.json")
    return rows


def stage_rows(sft: dict, dpo: dict, rl: dict) -> list[dict[str, Any]]:
    """One row per measure with a column per model: base (before SFT), then after SFT, DPO and RL."""
    cols = {"base": sft["before"], "sft": sft["after"], "dpo": dpo["after"], "rl": rl["after"]}
    return [{"measure": m, **{c: v[m] for c, v in cols.items()}} for m in MEASURES if all(m in v for v in cols.values())]
