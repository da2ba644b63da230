"""The held-out measures every post-training stage is scored on, before and after, on the same fixed items.

``measure_checkpoint(path, heldout_suite(instruction_data, preference_data), "cpu")`` scores one checkpoint item by
item; ``comparison_rows(before, after)`` (each change with its paired standard error) and ``stage_rows(sft, dpo, rl)``
make the tables assets and model cards show.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.common.files import stable_hash
from kiln.model.gpt2.model import GPT
from kiln.posttrain.instructions import arithmetic_reward
from kiln.model.loss import greedy_hits, head_inputs, token_logprobs
from kiln.posttrain.logprobs import encode_rows, score_examples, score_responses
from kiln.posttrain.sampling import complete, decode_completion
from kiln.posttrain.sft import IGNORE, chat_prompt_ids, read_pairs
from kiln.train.checkpoint import load_for_inference

MEASURES = {  # name -> what it is, shown beside the numbers
    "arithmetic_exact_match": "held-out arithmetic answered exactly (greedy; the RL task reward)",
    "arithmetic_answer_logprob": "mean log p of the correct answer to held-out arithmetic, question and working given "
                                 "(nats; the graded form of exact match)",
    "preference_accuracy": "held-out preference pairs whose correct response is more likely than the wrong one",
    "preference_margin": "mean log p(correct) - log p(wrong) on held-out preference pairs (nats)",
    "response_loss": "masked response loss on held-out instruction pairs (nats/token)",
    "response_token_accuracy": "held-out response tokens predicted exactly (teacher forcing)",
}


Scores = dict[str, dict[str, Any]]  # measure -> {"items": per-item contributions, "denom": their common divisor}


@torch.no_grad()
def measure_items(model: GPT, enc, arithmetic: list[dict], preferences: list[dict], instructions: list[dict],
                  max_new_tokens: int = 16, device: torch.device | str = "cpu") -> Scores:
    """Every before/after measure on fixed held-out items, item by item: a measure is sum(items) / denom, with the
    same denominator for every model on the same items, so a change has a paired standard error (``means``,
    ``comparison_rows``)."""
    model.eval()
    seq_len = model.config.block_size - 1
    res: Scores = {}
    if arithmetic:
        outs = complete(model, enc, [a["prompt"] for a in arithmetic], max_new_tokens, device=device)
        res["arithmetic_exact_match"] = {"items": [arithmetic_reward(decode_completion(enc, o[0]), a["answer"])
                                                   for o, a in zip(outs, arithmetic)], "denom": len(arithmetic)}
        res["arithmetic_answer_logprob"] = {"items": answer_logprobs(model, enc, arithmetic, seq_len, device),
                                            "denom": len(arithmetic)}
    if preferences:
        prompts = [p["prompt"] for p in preferences]
        chosen, _ = score_responses(model, enc, prompts, [p["chosen"] for p in preferences], seq_len, device=device)
        rejected, _ = score_responses(model, enc, prompts, [p["rejected"] for p in preferences], seq_len, device=device)
        diff = np.array(chosen) - np.array(rejected)
        res["preference_accuracy"] = {"items": (diff > 0).astype(float).tolist(), "denom": len(diff)}
        res["preference_margin"] = {"items": diff.tolist(), "denom": len(diff)}
    if instructions:
        nll, correct, count = [], [], 0
        for i in range(0, len(instructions), 16):
            chunk = instructions[i : i + 16]
            x, y = encode_rows(enc, [c["prompt"] for c in chunk], [c["response"] for c in chunk], seq_len)
            x, y = x.to(device), y.to(device)
            h, w = head_inputs(model, x)  # (B, T, C), (V, C): the head is applied a chunk at a time, no logits
            keep = y != IGNORE
            nll += (-token_logprobs(h, w, y) * keep).sum(1).tolist()  # per pair, summed over its response tokens
            correct += greedy_hits(h, w, y).sum(1).float().tolist()
            count += int(keep.sum())
        res["response_loss"] = {"items": nll, "denom": max(count, 1)}
        res["response_token_accuracy"] = {"items": correct, "denom": max(count, 1)}
    return res


def answer_rows(enc, item: dict) -> tuple[list[int], list[int]]:
    """(ids, mask) of an arithmetic item in the chat template with only its answer scored: the reference response
    from the space before its last occurrence of the answer, and the end-of-text ("3 + 18 =" given, " 21." scored).
    The cut falls at a pre-token boundary, so the two halves tokenize as the whole response does."""
    response, answer = item["response"], item["answer"]
    cut = response.rfind(" " + answer)
    cut = max(cut, 0)  # no answer in the response: score all of it
    given = chat_prompt_ids(enc, item["prompt"]) + enc.encode_ordinary(response[:cut])
    scored = [*enc.encode_ordinary(response[cut:]), enc.eot_token]
    return given + scored, [0] * len(given) + [1] * len(scored)


def answer_logprobs(model: GPT, enc, items: list[dict], seq_len: int, device: torch.device | str = "cpu",
                    batch_size: int = 32) -> list[float]:
    """log p(correct answer | question, working) for each arithmetic item, summed over the answer's tokens."""
    rows = [answer_rows(enc, it) for it in items]
    return score_examples(model, rows, seq_len, enc.eot_token, batch_size, device)[0]


def means(scores: Scores) -> dict[str, float]:
    """Each measure's value: its items' sum over its denominator."""
    return {m: float(np.sum(s["items"]) / s["denom"]) for m, s in scores.items()}


def paired_stderr(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Standard error of after - before for one measure, from the per-item differences on the same items
    (sqrt(n) * std(after_i - before_i) / denom); None when the items do not match or there are fewer than two."""
    a, b = np.asarray(after["items"], float), np.asarray(before["items"], float)
    if len(a) != len(b) or len(a) < 2 or after["denom"] != before["denom"]:
        return None
    return float(np.sqrt(len(a)) * np.std(a - b, ddof=1) / after["denom"])


def heldout_suite(instruction_data: dict, preference_data: dict) -> dict[str, list[dict]]:
    """The fixed held-out items every stage is measured on (the same lists before and after, for every stage)."""
    n = instruction_data["eval_items"]
    val = read_pairs(instruction_data["path"], "val")
    return {"arithmetic": [p for p in val if p["kind"] == "arithmetic"][:n], "instructions": val[:n],
            "preferences": read_pairs(preference_data["path"], "val")[:n]}


def suite_key(suite: dict[str, list[dict]]) -> str:
    return stable_hash(suite)[:16]


def measure_checkpoint(checkpoint: str, suite: dict[str, list[dict]], device: str) -> Scores:
    """The held-out measures of one checkpoint, item by item (on the GPU when the plan trains on one)."""
    dev = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    model, enc, _ = load_for_inference(checkpoint, dev)
    threads = torch.get_num_threads()
    if dev == "cpu":  # small latency-bound batches: one thread avoids synchronisation that costs more than it saves
        torch.set_num_threads(1)
    try:
        return measure_items(model, enc, suite["arithmetic"], suite["preferences"], suite["instructions"], device=dev)
    finally:
        torch.set_num_threads(threads)


def measure_before(init: dict, suite: dict[str, list[dict]], device: str) -> Scores:
    """The starting model's scores: the previous stage's "after" when it was taken on this same suite."""
    if init.get("suite_key") == suite_key(suite) and init.get("after_scores"):
        return dict(init["after_scores"])
    return measure_checkpoint(init["checkpoint"], suite, device)


NOISE_Z = 2.0  # a change is "beyond noise" when it is at least this many paired standard errors from zero


def comparison_rows(before: Scores, after: Scores) -> list[dict[str, Any]]:
    """[{measure, before, after, change, stderr, z, beyond_noise}] in MEASURES order, for metadata tables and model
    cards: stderr is the change's paired standard error over the items, z the change in standard errors."""
    b, a, rows = means(before), means(after), []
    for m in MEASURES:
        if m in before and m in after:
            se = paired_stderr(before[m], after[m])
            change = a[m] - b[m]
            z = change / se if se else (0.0 if change == 0 else None)
            rows.append({"measure": m, "before": b[m], "after": a[m], "change": change, "stderr": se, "z": z,
                         "beyond_noise": z is not None and abs(z) >= NOISE_Z, "items": len(after[m]["items"])})
    return rows


def comparison_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The comparison rows with what each measure is, as the before_after metadata table shows them."""
    return [{**r, "what": MEASURES[r["measure"]]} for r in rows]


def comparison_line(rows: list[dict[str, Any]]) -> str:
    def change(r: dict[str, Any]) -> str:
        return f" ({r['change']:+.3f} ± {r['stderr']:.3f})" if r.get("stderr") is not None else ""

    return "before -> after (change ± paired standard error): " + "; ".join(
        f"{r['measure']} {r['before']:.3f} -> {r['after']:.3f}{change(r)}" for r in rows)


def log_comparison(before: Scores, after: Scores, tracking_uri: str, run_id: str, step: int) -> list[dict[str, Any]]:
    """The side-by-side rows, logged to the stage's MLflow run as before.<m> / after.<m> / stderr.<m> and a JSON table."""
    from kiln.common.metrics import job_logger

    rows = comparison_rows(before, after)
    tracker = job_logger(tracking_uri, run_id)
    tracker.log({**{f"before.{k}": v for k, v in means(before).items()},
                 **{f"after.{k}": v for k, v in means(after).items()},
                 **{f"stderr.{r['measure']}": r["stderr"] for r in rows if r["stderr"] is not None}}, step)
    tracker.flush()
    tracker.log_dict({"rows": rows, "measures": MEASURES}, "before_after.json")
    return rows


LOWER_IS_BETTER = ("response_loss",)  # the measures where a fall is an improvement


def worse_beyond_noise(row: dict[str, Any]) -> bool:
    """Whether a comparison row's change is beyond noise in the worse direction (a rise for LOWER_IS_BETTER)."""
    worse = row["change"] > 0 if row["measure"] in LOWER_IS_BETTER else row["change"] < 0
    return bool(row.get("beyond_noise")) and worse


def stage_rows(sft: dict, dpo: dict, rl: dict, ppo: dict | None = None) -> list[dict[str, Any]]:
    """One row per measure with a column per model: base (before SFT), then after SFT, DPO and RL (and PPO)."""
    cols = {"base": sft["before"], "sft": sft["after"], "dpo": dpo["after"], "rl": rl["after"],
            **({"ppo": ppo["after"]} if ppo is not None else {})}
    return [{"measure": m, **{c: v[m] for c, v in cols.items()}} for m in MEASURES if all(m in v for v in cols.values())]


def change_cell(row: dict[str, Any]) -> str:
    """"+0.070 ± 0.026 *": a stage's change with its paired standard error, * when beyond noise."""
    if row.get("stderr") is None:
        return f"{row['change']:+.3f}"
    return f"{row['change']:+.3f} ± {row['stderr']:.3f}" + (" *" if row.get("beyond_noise") else "")


def change_rows(stages: dict[str, dict]) -> list[dict[str, Any]]:
    """One row per measure with each stage's change (from its before_after rows) as ``change_cell`` writes it."""
    by_stage = {name: {r["measure"]: r for r in st.get("before_after", [])} for name, st in stages.items()}
    return [{"measure": m, **{name: change_cell(rows[m]) if m in rows else "-" for name, rows in by_stage.items()}}
            for m in MEASURES if any(m in rows for rows in by_stage.values())]
