"""lm-eval adapter: a Kiln GPT + tiktoken encoding as an ``lm_eval`` model registered as ``kiln``.

In code: ``KilnLM(model, encoding, progress=print)`` (``progress`` gets ``eval 120/400: loglikelihood | 35.2 requests/s |
8s left`` lines as requests are answered); CLI: ``python -m kiln.evaluation.suite --model kiln --model_args checkpoint=P``.

Multiple-choice items arrive as one log-likelihood request per ending, all with the same context. KilnLM runs such a
context once into a KV cache, without the vocabulary head, and scores all its endings against that cache
(``share_context``; off with ``share_context=False`` or the environment variable ``KILN_EVAL_SHARE_CONTEXT=0``, which
gives one whole row per request, as lm-eval's HFLM runs them). Both give the same numbers to float rounding;
bench/bench_eval_speed.py times them against HFLM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import lm_eval.models  # noqa: F401  (lm-eval's own models first: get_model() skips them once "kiln" is in)
import tiktoken
import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from kiln.model.cache import KVCache
from kiln.model.generate import generate
from kiln.model.gpt2.model import GPT
from kiln.tokens.tokenizer import end_token
from kiln.train.telemetry import format_duration

log = logging.getLogger(__name__)

Row = tuple[list[int], list[int]]  # (model input tokens, targets: the tokens after its last len(targets) positions)
KNOWN_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k"}
SHARE_ENV = "KILN_EVAL_SHARE_CONTEXT"  # "0" / "false" / "no" / "off": score each request as its own row
# A forward call costs a fixed part (on a CPU, streaming every weight from memory: tens of tokens' worth for a 135M
# model in float32) plus a part per token run, padding and re-run context tails included (bench/eval_tokens.py
# counts those). One-row batches are long rows, so they pad little (ROW_SLACK); a shared batch's passes are short
# endings, where a tighter bound means many small calls, each paying the fixed part (SHARE_SLACK).
ROW_SLACK = 1.05  # a one-row batch runs at most this many times the tokens its rows need
SHARE_SLACK = 1.15  # a shared batch, and each pass of it, runs at most this many times the tokens its rows need
LOGITS_ENV = "KILN_EVAL_LOGITS_GIB"  # the most memory one pass's float32 logits may take (default LOGITS_GIB)
LOGITS_GIB = 2.0  # CPU-safe; a GPU with room scores faster with more (bench/gpu_released.sh gives 8)


def _flag(value: Any) -> bool:
    return str(value).strip().lower() not in ("0", "false", "no", "off", "")


class RequestProgress:
    """Counts the answered requests of one lm-eval call and tells ``sink`` a line such as
    ``eval 120/400: loglikelihood | 35.2 requests/s | 8s left``: at the first update, then every ``every_s`` seconds,
    and at the last request (``kiln run`` draws these as a bar with the time left)."""

    def __init__(self, sink: Callable[[str], None] | None, kind: str, total: int, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.sink, self.kind, self.total, self.every_s, self.clock = sink, kind, int(total), every_s, clock
        self.done, self.t0, self.last = 0, clock(), None

    def reached(self, done: int) -> None:
        """``done`` of ``total`` requests are answered."""
        if self.sink is None or self.total <= 0:
            return
        self.done = min(self.total, max(self.done, int(done)))
        now = self.clock()
        if self.done < self.total and self.last is not None and now - self.last < self.every_s:
            return
        self.last = now
        rate = self.done / max(now - self.t0, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        self.sink(f"eval {self.done}/{self.total}: {self.kind} | {rate:,.1f} requests/s | {format_duration(left)} left")


@register_model("kiln")
class KilnLM(LM):
    """Scores and generates text with a Kiln ``GPT``; all requests run in eval mode under inference_mode.

    The model is moved to ``device`` and set to eval mode in place. Log-probabilities are normalised over the
    tokenizer's real ids (``encoding.n_vocab``); the embedding's padding ids beyond it are never scored or generated.
    ``share_context``: log-likelihood requests with the same context (a multiple-choice item's endings) run that
    context once, without logits (``_score_shared``); False scores every request as its own row (the default comes
    from the environment variable KILN_EVAL_SHARE_CONTEXT, on unless it is 0).
    """

    def __init__(
        self,
        model: GPT,
        encoding: tiktoken.Encoding,
        device: str = "cpu",
        batch_size: int | str = 16,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        seed: int = 1234,
        progress: Callable[[str], None] | None = None,
        share_context: bool | str | None = None,
        logits_gib: float | None = None,
    ) -> None:
        super().__init__()
        block = model.config.block_size
        if encoding.n_vocab > model.config.vocab_size:
            raise ValueError(
                f"tokenizer has {encoding.n_vocab} ids but the model's vocab_size is {model.config.vocab_size}: "
                "they do not belong together"
            )
        if max_length is not None and not 1 <= int(max_length) <= block:
            raise ValueError(f"max_length={max_length} must be between 1 and the model's block_size={block}")
        if isinstance(batch_size, str):  # lm-eval's CLI may pass "auto" / "auto:N" / "8"
            batch_size = int(batch_size) if batch_size.isdigit() else 16
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._device = torch.device(device)
        self.model = model.to(self._device).eval()
        self.enc = encoding
        self.eot = encoding.eot_token
        self.n_vocab = encoding.n_vocab
        self.max_length = int(max_length or block)
        self.batch_size = int(batch_size)
        # Input tokens per forward pass: batch_size rows of max_length, proportionally more shorter rows, and never
        # more than the float32 logits (tokens x vocabulary) that logits_gib holds, one full-length row at least: a
        # model with a long context and a large vocabulary would otherwise ask for tens of GB per pass.
        gib = float(os.environ.get(LOGITS_ENV, LOGITS_GIB) if logits_gib is None else logits_gib)
        if not gib > 0:
            raise ValueError(f"logits_gib ({LOGITS_ENV}) must be > 0, got {gib}")
        by_memory = int(gib * 2**30 / (4 * model.config.vocab_size))
        self.pass_tokens = max(self.max_length, min(self.batch_size * self.max_length, by_memory))
        self.max_gen_toks = int(max_gen_toks)
        self.generator = torch.Generator(device=self._device).manual_seed(int(seed))
        self.progress = progress  # told each request type's progress (RequestProgress lines); None: silent
        # loglikelihood runs a context once for all its endings (KV cache); None: on unless KILN_EVAL_SHARE_CONTEXT=0
        self.share_context = _flag(os.environ.get(SHARE_ENV, "1") if share_context is None else share_context)

    # ---- construction from lm-eval's --model_args -------------------------------------------------
    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, device: str = "cpu", **kwargs: Any) -> "KilnLM":
        """Load a Kiln checkpoint (kiln.train.checkpoint.load_for_inference) and wrap it."""
        from kiln.train.checkpoint import load_for_inference

        model, encoding, _meta = load_for_inference(checkpoint, map_location=device)
        return cls(model, encoding, device=device, **kwargs)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None) -> "KilnLM":
        """``{"checkpoint": PATH, "device": ..., "batch_size": ...}``; explicit args beat lm-eval's CLI defaults."""
        args = dict(arg_dict)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k != "max_batch_size"}
        if "device" not in args and str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            extra["device"] = "cpu"  # lm-eval's CLI defaults to cuda:0; only an explicit device=cuda should fail
        for k, v in extra.items():
            args.setdefault(k, v)
        if "share_context" in args:
            args["share_context"] = _flag(args["share_context"])
        if "checkpoint" not in args:
            raise ValueError("the kiln lm-eval model needs --model_args checkpoint=PATH[,device=cpu,batch_size=16]")
        for key in ("max_length", "max_gen_toks", "seed"):
            if key in args:
                args[key] = int(args[key])
        return cls.from_checkpoint(args.pop("checkpoint"), **args)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> "KilnLM":
        """``checkpoint=PATH[,device=cuda,batch_size=32,max_length=512]``, as ``lm_eval --model_args`` gives it."""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # ---- tokens --------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def _rows(self, ctx: list[int], cont: list[int]) -> list[Row]:
        """Split one scoring of ``cont`` after ``ctx`` into model rows, left-truncated to max_length.

        A continuation longer than max_length is scored in consecutive pieces, each with the most context that fits.
        """
        L = self.max_length
        rows = []
        for s in range(0, len(cont), L):
            piece = cont[s : s + L]
            seq = (ctx + cont[: s + len(piece)])[-(L + 1) :]  # <= L + 1 tokens; ctx holds >= 1 token
            rows.append((seq[:-1], piece))
        return rows

    def _logits_at(self, x: torch.Tensor, b_of: torch.Tensor, n_in: torch.Tensor, tgts: list[list[int]],
                   cache: KVCache | None = None) -> list[tuple[float, bool]]:
        """(sum of target log-probs, all targets greedy) per scored row of one forward pass over ``x`` (B, T): row r
        reads batch row ``b_of[r]``, whose input holds ``n_in[r]`` tokens, its targets predicted at the last
        ``len(tgts[r])`` of them. The vocabulary head runs at those positions alone (``_head_at``), not at every
        position of every row: most of a row is context, whose logits nobody reads."""
        dev = x.device
        K = max(len(t) for t in tgts)
        y = torch.tensor([t + [0] * (K - len(t)) for t in tgts], dtype=torch.long, device=dev)  # (R, K)
        n_tg = torch.tensor([len(t) for t in tgts], device=dev)  # (R,)
        ar = torch.arange(K, device=dev)  # (K,)
        valid = ar[None, :] < n_tg[:, None]  # (R, K)
        pos = torch.where(valid, (n_in - n_tg)[:, None] + ar[None, :], 0)  # (R, K) positions predicting y
        run = (lambda: self.model(x)) if cache is None else (lambda: self.model(x, cache=cache))
        if self._head() is None:  # a model whose head is unknown: every position's logits, then the targets'
            sel = run()[b_of[:, None], pos]  # (R, K, V)
        else:
            with self._head_at(b_of, pos):
                sel = run()  # (R, K, V)
        logp = F.log_softmax(sel[..., : self.n_vocab].float(), dim=-1)  # (R, K, Vr)
        tok = logp.gather(-1, y[..., None]).squeeze(-1)  # (R, K)
        total = torch.where(valid, tok, 0.0).sum(dim=1)  # (R,)
        greedy = ((logp.argmax(dim=-1) == y) | ~valid).all(dim=1)  # (R,)
        return list(zip(total.tolist(), greedy.tolist()))

    @torch.inference_mode()
    def _score_rows(self, rows: Sequence[Row], scored: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
        """(sum of target log-probs, all targets greedy) per row; batched longest first, padded right.

        Rows with the same input tokens (e.g. one-token answers " A".." D" after one question) share one forward
        pass, each gathering its own targets from the shared logits. A batch holds at most ``pass_tokens`` input
        tokens (batch_size x max_length, capped by logits_gib): full-length rows, or proportionally more shorter ones,
        as long as its padding stays within ROW_SLACK times its rows' own tokens (a long row does not pad many much
        shorter ones to its length). ``scored(n)`` is told the number of rows scored so far after each batch.
        """
        self.model.eval()
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        uniq: dict[tuple[int, ...], int] = {}
        owner = [uniq.setdefault(tuple(r[0]), len(uniq)) for r in rows]  # row -> index of its distinct input
        inputs = list(uniq)
        members: list[list[int]] = [[] for _ in inputs]
        for i, u in enumerate(owner):
            members[u].append(i)
        order = sorted(range(len(inputs)), key=lambda u: -len(inputs[u]))
        dev = self._device
        budget = self.pass_tokens  # input tokens per forward pass, padding included
        start = done = 0
        while start < len(order):
            T = len(inputs[order[start]])  # the longest input of this batch (sorted longest first)
            cap, end, own = max(1, budget // max(T, 1)), start + 1, T
            while end < len(order) and end - start < cap:
                n = len(inputs[order[end]])
                if (end - start + 1) * T > ROW_SLACK * (own + n):
                    break
                own, end = own + n, end + 1
            us = order[start:end]
            start = end
            x = torch.tensor([list(inputs[u]) + [0] * (T - len(inputs[u])) for u in us], dtype=torch.long, device=dev)  # (B, T)
            ridx = [i for u in us for i in members[u]]  # the R rows scored from this batch
            b_of = torch.tensor([j for j, u in enumerate(us) for _ in members[u]], device=dev)  # (R,) row -> batch index
            n_in = torch.tensor([len(rows[i][0]) for i in ridx], device=dev)  # (R,)
            # right padding cannot reach earlier positions (causal)
            for i, res in zip(ridx, self._logits_at(x, b_of, n_in, [rows[i][1] for i in ridx])):
                out[i] = res
            done += len(ridx)
            if scored is not None:
                scored(done)
        return out

    def _score_groups(self, groups: list[list[Row]], kind: str, tell: RequestProgress | None = None,
                      offset: int = 0) -> list[tuple[float, bool]]:
        """Score every row of every group in shared batches; sum log-probs and AND greediness per group. Progress
        counts requests (groups) in proportion to the rows scored, as batches mix rows of many requests; ``tell``
        (default: a new one for these groups) is told ``offset`` more requests than these."""
        flat = [row for g in groups for row in g]
        tell = tell if tell is not None else RequestProgress(self.progress, kind, len(groups))
        scores = iter(self._score_rows(flat, lambda n: tell.reached(offset + len(groups) * n // max(len(flat), 1))))
        results = []
        for g in groups:
            parts = [next(scores) for _ in g]
            results.append((sum(p[0] for p in parts), all(p[1] for p in parts)))
        return results

    # ---- one context, many endings: the context's forward pass once ------------------------------
    def _head(self) -> torch.nn.Module | None:
        """The model's vocabulary head (kiln.model.families.Parts.head), or None for a model without a known one."""
        try:
            from kiln.model.families import of

            return self.model.get_submodule(of(self.model.config).parts.head.removesuffix(".weight"))
        except (AttributeError, KeyError, ValueError, TypeError):
            return None

    def _shareable(self, pairs: Sequence[tuple[list[int], list[int]]]) -> dict[tuple[int, ...], list[int]]:
        """{context tokens: indices of the requests scored after it by ``_score_shared``}.

        A request qualifies when it is one model row without truncation (context + continuation fit max_length + 1,
        so ``_rows`` would give the row ctx + cont[:-1]) and its context has two tokens or more. A context's requests
        go there when they need two distinct rows or more: both paths run the vocabulary head only where a target is
        predicted (``_head_at``), so the one-row path runs the context's first len(ctx) - 1 tokens once per distinct
        row ctx + cont[:-1], the shared path once in all; with one row (a lone request, or one-token endings, which
        the one-row path already answers from one row) the two do the same work. Which requests go there does not
        depend on the batch size.
        """
        by_ctx: dict[tuple[int, ...], list[int]] = {}
        for i, (ctx, cont) in enumerate(pairs):
            if cont and len(ctx) >= 2 and len(ctx) + len(cont) <= self.max_length + 1:
                by_ctx.setdefault(tuple(ctx), []).append(i)
        out = {}
        for ctx, idx in by_ctx.items():
            if len({tuple(pairs[i][1][:-1]) for i in idx}) >= 2:  # the distinct ending inputs
                out[ctx] = idx
        return out

    @contextlib.contextmanager
    def _head_at(self, b_of: torch.Tensor | None = None, pos: torch.Tensor | None = None):
        """While open, the model's vocabulary head is handed only the hidden states at (``b_of[r]``, ``pos[r, k]``), so
        the model returns (R, K, V) logits instead of (B, T, V); without ``b_of``, zero positions: a prefill makes its
        KV cache, not logits nobody reads. A model whose head ``_head`` does not know computes all its logits."""
        def pick(module: torch.nn.Module, args: tuple) -> tuple:
            h = args[0]  # (B, T, C)
            return (h[..., :0, :] if b_of is None else h[b_of[:, None], pos], *args[1:])

        head = self._head()
        handle = None if head is None else head.register_forward_pre_hook(pick)
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()

    @torch.inference_mode()
    def _score_shared(self, groups: list[tuple[list[int], list[list[int]]]],
                      scored: Callable[[int], None] | None = None) -> list[list[tuple[float, bool]]]:
        """(sum of log-probs, all greedy) of each ending of each (context, endings) group, each context run once.

        Groups go longest context first, and consecutive endings form a batch. A batch caches the first ``s`` tokens
        of each of its contexts, s = its shortest context less one: one pass over (G, s) into a KV cache, the
        vocabulary head left out. Its endings then run as rows ctx[s:] + ending[:-1] from position s, each over a copy
        of its own context's cached keys and values: causal attention sees that context and the row itself, so a
        row's logits are those of the whole row ctx + ending[:-1] run from position 0, to float rounding. Endings of
        one context with the same ending[:-1] (one-token answers " A" .. " D") read their targets from one row. The
        rows run longest first in passes of rows of similar length (``_passes``), padded right.

        A batch stops where its rows x positions (the cache included) would pass ``pass_tokens`` (the memory of an
        ``_score_rows`` batch) or where its tokens would pass SHARE_SLACK times those its contexts and endings
        need (a context longer than s re-runs its tail in each of its ending rows). ``scored(n)`` is told the
        endings scored so far after each pass.
        """
        self.model.eval()
        order = sorted(range(len(groups)), key=lambda g: (-len(groups[g][0]), groups[g][0]))
        rowsets = []  # per group: [(ending[:-1], the endings k that have it)]
        for _, ends in groups:
            same: dict[tuple[int, ...], list[int]] = {}
            for k, e in enumerate(ends):
                same.setdefault(tuple(e[:-1]), []).append(k)
            rowsets.append(list(same.items()))
        items = [(g, j) for g in order for j in range(len(rowsets[g]))]  # (group, row), contexts longest first
        out: list[list[tuple[float, bool]]] = [[(0.0, True)] * len(e) for _, e in groups]
        dev, start, done = self._device, 0, 0
        while start < len(items):
            end, gs = self._shared_batch(groups, rowsets, items, start)
            batch, start = items[start:end], end
            s = len(groups[gs[-1]][0]) - 1
            prefix = None
            if s > 0:
                prefix = KVCache.for_model(self.model, len(gs), max_len=s)
                x = torch.tensor([groups[g][0][:s] for g in gs], dtype=torch.long, device=dev)  # (G, s)
                with self._head_at():
                    self.model(x, cache=prefix)
            at = {g: j for j, g in enumerate(gs)}
            inputs = [groups[g][0][s:] + list(rowsets[g][j][0]) for g, j in batch]  # rows after the cached prefix
            for part in self._passes([len(t) for t in inputs]):
                T = len(inputs[part[0]])
                cache = KVCache.for_model(self.model, len(part), max_len=s + T)
                if prefix is not None:
                    row_of = torch.tensor([at[batch[i][0]] for i in part], device=dev)  # (R,) row -> prefill row
                    cache.k[:, :, :, :s] = prefix.k[:, row_of]
                    cache.v[:, :, :, :s] = prefix.v[:, row_of]
                    cache.pos = s
                x = torch.tensor([inputs[i] + [0] * (T - len(inputs[i])) for i in part], dtype=torch.long,
                                 device=dev)  # (R, T)
                who = [(r, batch[i][0], k) for r, i in enumerate(part) for k in rowsets[batch[i][0]][batch[i][1]][1]]
                b_of = torch.tensor([r for r, _, _ in who], device=dev)  # (E,) ending -> row of the pass
                n_in = torch.tensor([len(inputs[part[r]]) for r, _, _ in who], device=dev)  # (E,)
                # right padding cannot reach earlier positions
                got = self._logits_at(x, b_of, n_in, [groups[g][1][k] for _, g, k in who], cache=cache)
                del cache
                for (_, g, k), res in zip(who, got):
                    out[g][k] = res
                done += len(who)
                if scored is not None:
                    scored(done)
            del prefix
        return out

    def _shared_batch(self, groups: list[tuple[list[int], list[list[int]]]], rowsets: list[list[tuple[tuple, list]]],
                      items: list[tuple[int, int]], start: int) -> tuple[int, list[int]]:
        """The next batch of ``_score_shared``: the end of its items (``items[start:end]``, at least one) and its
        groups in order, the batch stopping before its rows x positions pass ``pass_tokens`` or its tokens pass
        SHARE_SLACK times those its contexts and endings need."""
        end, gs = start, []
        reach = need = spans = 0  # max over rows of len(ctx) - 1 + len(ending); tokens needed; sum of those lengths
        while end < len(items):
            g, j = items[end]
            ctx, n_row = groups[g][0], len(rowsets[g][j][0]) + 1  # the row: last context token, ending[:-1]
            s = len(ctx) - 1  # contexts go longest first: the newest group's is the shortest
            span = s + n_row
            new = not gs or gs[-1] != g
            n_need = need + (s if new else 0) + n_row
            rows = end - start + 1
            tokens = (len(gs) + new) * s + spans + span - rows * s  # prefill (G, s), rows after position s
            if end > start and (rows * max(reach, span) > self.pass_tokens or tokens > SHARE_SLACK * n_need):
                break
            if new:
                gs.append(g)
            reach, need, spans = max(reach, span), n_need, spans + span
            end += 1
        return end, gs

    @staticmethod
    def _passes(lengths: Sequence[int]) -> list[list[int]]:
        """Row indices in passes, longest rows first: a pass takes the next shorter row while its padded tokens stay
        within SHARE_SLACK times its rows' own tokens."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        passes: list[list[int]] = []
        total = 0
        for i in order:
            if passes and (len(passes[-1]) + 1) * lengths[passes[-1][0]] <= SHARE_SLACK * (total + lengths[i]):
                passes[-1].append(i)
                total += lengths[i]
            else:
                passes.append([i])
                total = lengths[i]
        return passes

    # ---- lm-eval request types ----------------------------------------------------------------
    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """(context, continuation) -> (log p(continuation | context), continuation is the greedy decode).

        With ``share_context``, the requests ``_shareable`` picks are scored by ``_score_shared``, grouped by context
        tokens (each context run once, without logits, for all its endings); the others, and all of them without it,
        one row per request (longer ones in pieces, left-truncated as ``_rows`` says)."""
        pairs = []
        for req in requests:
            context, continuation = req.args
            n_sp = len(context) - len(context.rstrip())  # trailing spaces belong to the continuation's tokens
            if n_sp:
                context, continuation = context[:-n_sp], context[-n_sp:] + continuation
            ctx = self._encode(context) if context else [self.eot]
            pairs.append((ctx, self._encode(continuation)))
        shared = self._shareable(pairs) if self.share_context else {}
        tell = RequestProgress(self.progress, "loglikelihood", len(requests))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        if shared:
            groups = []  # (context, its distinct endings) and, per ending, the requests it answers
            answers: list[list[list[int]]] = []
            for ctx, idx in shared.items():
                ends: dict[tuple[int, ...], list[int]] = {}
                for i in idx:
                    ends.setdefault(tuple(pairs[i][1]), []).append(i)
                groups.append((list(ctx), [list(e) for e in ends]))
                answers.append(list(ends.values()))
            n_ends = sum(len(e) for _, e in groups)
            n_shared = sum(len(idx) for idx in shared.values())
            scores = self._score_shared(groups, lambda n: tell.reached(n_shared * n // max(n_ends, 1)))
            for per_end, who in zip(scores, answers):
                for res, idx in zip(per_end, who):
                    for i in idx:
                        results[i] = res
        rest = [i for i, r in enumerate(results) if r is None]
        if rest:
            got = self._score_groups([self._rows(*pairs[i]) for i in rest], "loglikelihood", tell,
                                     offset=len(requests) - len(rest))
            for i, res in zip(rest, got):
                results[i] = res
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """(text,) -> log p(text | EOT), scored in disjoint windows of max_length (lm-eval's rolling scheme)."""
        groups = []
        for req in requests:
            (text,) = req.args
            windows = lm_utils.get_rolling_token_windows(
                token_list=self._encode(text), prefix_token=self.eot, max_seq_len=self.max_length, context_len=1
            )
            groups.append([row for w in map(lm_utils.make_disjoint_window, windows) for row in self._rows(*w)])
        results = [lp for lp, _ in self._score_groups(groups, "loglikelihood_rolling")]
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return results

    @torch.inference_mode()
    def _generate_batch(
        self, contexts: Sequence[str], max_new: int, temperature: float, top_k: int | None, until: Sequence[str],
        skip_special: bool = False,
    ) -> list[str]:
        """Decode up to max_new tokens per context, all rows together through one KV cache (kiln.model.generate).

        Greedy when temperature <= 0. A row stops at the model's end token (kiln.tokens.tokenizer.end_token: an imported
        model's end of sequence, else EOT) or once its text holds a stop string; the rest go on.
        Rows are right-padded; a longer context is fed a token a step while the shorter ones already decode.
        A context is left-truncated to max_length - max_new tokens, as lm-eval's HFLM truncates it, so the answer
        is decoded with the same context in view (and through the KV cache). ``skip_special`` leaves special
        tokens (chat markers) out of the returned text, as HFLM's decode does; stop strings are matched with them in.
        """
        self.model.eval()
        keep = self.max_length - max_new if max_new < self.max_length else self.max_length
        seqs = [(self._encode(c) if c else [self.eot])[-keep:] for c in contexts]
        T = max(len(s) for s in seqs)
        x = torch.tensor([s + [self.eot] * (T - len(s)) for s in seqs], dtype=torch.long, device=self._device)  # (B, T)
        stop = (lambda i, toks: any(s in self.enc.decode(toks) for s in until)) if until else None
        end = end_token(self.enc)  # the model's own end of sequence (an imported one's, as HFLM stops at its eos)
        out = generate(self.model, x, max_new, temperature=temperature, top_k=top_k, stop_token=end,
                       n_vocab=self.n_vocab, generator=self.generator, lengths=[len(s) for s in seqs],
                       window=self.max_length, stop=stop).tolist()
        new = [row[len(s) : len(s) + max_new] for row, s in zip(out, seqs)]
        new = [n[: n.index(end)] if end in n else n for n in new]
        if skip_special:
            specials = {self.enc.encode_single_token(t) for t in self.enc.special_tokens_set}
            new = [[t for t in n if t not in specials] for n in new]
        texts = [self.enc.decode(n) for n in new]
        return [t[: min([t.find(s) for s in until if s in t], default=len(t))] for t in texts]

    def _generate(self, context: str, max_new: int, temperature: float, top_k: int | None, until: Sequence[str]) -> str:
        """One context through ``_generate_batch``."""
        return self._generate_batch([context], max_new, temperature, top_k, until)[0]

    def generate_until(self, requests: list[Any]) -> list[str]:
        """(context, gen_kwargs) -> continuation, cut before the first ``until`` string.

        gen_kwargs: until (str | list), max_gen_toks, do_sample (default: temperature > 0), temperature
        (default 1.0 when sampling), top_k. Greedy unless sampling is asked for. Requests with the same settings
        decode together in batches of batch_size, longest context first. Special tokens (chat markers) are left out
        of the text, as lm-eval's HFLM leaves them out.
        """
        groups: dict[tuple, list[int]] = {}  # (max_new, temperature, top_k, until) -> request indices
        for n, req in enumerate(requests):
            context, kw = req.args
            kw = dict(kw or {})
            unknown = sorted(set(kw) - KNOWN_GEN_KWARGS)
            if unknown:
                log.warning("kiln generate_until ignores gen_kwargs %s", unknown)
            until = kw.get("until") or []
            until = tuple(s for s in ([until] if isinstance(until, str) else until) if s)
            temperature = float(kw.get("temperature") or 0.0)
            do_sample = kw.get("do_sample")
            do_sample = temperature > 0 if do_sample is None else str(do_sample).lower() in ("true", "1")
            temp = (temperature if temperature > 0 else 1.0) if do_sample else 0.0
            max_new = int(kw.get("max_gen_toks") or self.max_gen_toks)
            top_k = int(kw["top_k"]) if kw.get("top_k") else None
            key = (max_new, temp, top_k, until)
            groups.setdefault(key, []).append(n)
        out: list[str] = [""] * len(requests)
        tell, answered = RequestProgress(self.progress, "generate_until", len(requests)), 0
        for (max_new, temp, top_k, until), idx in groups.items():
            idx = sorted(idx, key=lambda n: -len(requests[n].args[0]))
            for start in range(0, len(idx), self.batch_size):
                chunk = idx[start : start + self.batch_size]
                texts = self._generate_batch([requests[n].args[0] for n in chunk], max_new, temp, top_k, until,
                                             skip_special=True)
                for n, text in zip(chunk, texts):
                    out[n] = text
                answered += len(chunk)
                tell.reached(answered)
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def get_model_info(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "block_size": cfg.block_size,
            "n_layer": cfg.n_layer,
            "n_embd": cfg.n_embd,
            "tokenizer": self.enc.name,
        }
