"""lm-eval adapter: a Kiln GPT + tiktoken encoding as an ``lm_eval`` model registered as ``kiln``.

In code: ``KilnLM(model, encoding)``; CLI: ``python -m kiln.evaluation.suite --model kiln --model_args checkpoint=P``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import lm_eval.models  # noqa: F401  (lm-eval's own models first: get_model() skips them once "kiln" is in)
import tiktoken
import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from kiln.model import GPT

log = logging.getLogger(__name__)

Row = tuple[list[int], list[int]]  # (model input tokens, targets: the tokens after its last len(targets) positions)
KNOWN_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k"}


@register_model("kiln")
class KilnLM(LM):
    """Scores and generates text with a Kiln ``GPT``; all requests run in eval mode under inference_mode.

    The model is moved to ``device`` and set to eval mode in place. Log-probabilities are normalised over the
    tokenizer's real ids (``encoding.n_vocab``); the embedding's padding ids beyond it are never scored or generated.
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
        self.max_gen_toks = int(max_gen_toks)
        self.generator = torch.Generator(device=self._device).manual_seed(int(seed))

    # ---- construction from lm-eval's --model_args -------------------------------------------------
    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, device: str = "cpu", **kwargs: Any) -> "KilnLM":
        """Load a Kiln checkpoint (kiln.checkpoint.load_for_inference) and wrap it."""
        from kiln.checkpoint import load_for_inference

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

    @torch.inference_mode()
    def _score_rows(self, rows: Sequence[Row]) -> list[tuple[float, bool]]:
        """(sum of target log-probs, all targets greedy) per row; batched longest first, padded right."""
        self.model.eval()
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            inps = [rows[i][0] for i in idx]
            tgts = [rows[i][1] for i in idx]
            B, T, K = len(idx), len(inps[0]), max(len(t) for t in tgts)
            x = torch.tensor([r + [0] * (T - len(r)) for r in inps], dtype=torch.long, device=self._device)  # (B, T)
            y = torch.tensor([t + [0] * (K - len(t)) for t in tgts], dtype=torch.long, device=self._device)  # (B, K)
            n_in = torch.tensor([len(r) for r in inps], device=self._device)  # (B,)
            n_tg = torch.tensor([len(t) for t in tgts], device=self._device)  # (B,)
            ar = torch.arange(K, device=self._device)  # (K,)
            valid = ar[None, :] < n_tg[:, None]  # (B, K)
            pos = torch.where(valid, (n_in - n_tg)[:, None] + ar[None, :], 0)  # (B, K) positions predicting y
            logits = self.model(x)  # (B, T, V); right padding cannot reach earlier positions (causal)
            sel = logits[torch.arange(B, device=self._device)[:, None], pos][..., : self.n_vocab]  # (B, K, Vr)
            logp = F.log_softmax(sel.float(), dim=-1)  # (B, K, Vr)
            tok = logp.gather(-1, y[..., None]).squeeze(-1)  # (B, K)
            total = torch.where(valid, tok, 0.0).sum(dim=1)  # (B,)
            greedy = ((logp.argmax(dim=-1) == y) | ~valid).all(dim=1)  # (B,)
            for i, lp, g in zip(idx, total.tolist(), greedy.tolist()):
                out[i] = (lp, g)
        return out

    def _score_groups(self, groups: list[list[Row]]) -> list[tuple[float, bool]]:
        """Score every row of every group in shared batches; sum log-probs and AND greediness per group."""
        flat = [row for g in groups for row in g]
        scores = iter(self._score_rows(flat))
        results = []
        for g in groups:
            parts = [next(scores) for _ in g]
            results.append((sum(p[0] for p in parts), all(p[1] for p in parts)))
        return results

    # ---- lm-eval request types ----------------------------------------------------------------
    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """(context, continuation) -> (log p(continuation | context), continuation is the greedy decode)."""
        groups = []
        for req in requests:
            context, continuation = req.args
            n_sp = len(context) - len(context.rstrip())  # trailing spaces belong to the continuation's tokens
            if n_sp:
                context, continuation = context[:-n_sp], context[-n_sp:] + continuation
            ctx = self._encode(context) if context else [self.eot]
            groups.append(self._rows(ctx, self._encode(continuation)))
        results = self._score_groups(groups)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """(text,) -> log p(text | EOT), scored in disjoint windows of max_length (lm-eval's rolling scheme)."""
        groups = []
        for req in requests:
            (text,) = req.args
            windows = lm_utils.get_rolling_token_windows(
                token_list=self._encode(text), prefix_token=self.eot, max_seq_len=self.max_length, context_len=1
            )
            groups.append([row for w in map(lm_utils.make_disjoint_window, windows) for row in self._rows(*w)])
        results = [lp for lp, _ in self._score_groups(groups)]
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return results

    @torch.inference_mode()
    def _generate(
        self, context: str, max_new: int, temperature: float, top_k: int | None, until: Sequence[str]
    ) -> str:
        """Decode up to max_new tokens (greedy when temperature <= 0); stop at EOT or a stop string."""
        self.model.eval()
        ids = self._encode(context) if context else [self.eot]
        new: list[int] = []
        for _ in range(max_new):
            x = torch.tensor([(ids + new)[-self.max_length :]], dtype=torch.long, device=self._device)  # (1, T)
            logits = self.model(x)[0, -1, : self.n_vocab].float()  # (Vr,)
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=self.generator))
            if nxt == self.eot:
                break
            new.append(nxt)
            if until and any(s in self.enc.decode(new) for s in until):
                break
        text = self.enc.decode(new)
        cut = min([text.find(s) for s in until if s in text], default=len(text))
        return text[:cut]

    def generate_until(self, requests: list[Any]) -> list[str]:
        """(context, gen_kwargs) -> continuation, cut before the first ``until`` string.

        gen_kwargs: until (str | list), max_gen_toks, do_sample (default: temperature > 0), temperature
        (default 1.0 when sampling), top_k. Greedy unless sampling is asked for.
        """
        out = []
        for req in requests:
            context, kw = req.args
            kw = dict(kw or {})
            unknown = sorted(set(kw) - KNOWN_GEN_KWARGS)
            if unknown:
                log.warning("kiln generate_until ignores gen_kwargs %s", unknown)
            until = kw.get("until") or []
            until = [s for s in ([until] if isinstance(until, str) else until) if s]
            temperature = float(kw.get("temperature") or 0.0)
            do_sample = kw.get("do_sample")
            do_sample = temperature > 0 if do_sample is None else str(do_sample).lower() in ("true", "1")
            temp = (temperature if temperature > 0 else 1.0) if do_sample else 0.0
            max_new = int(kw.get("max_gen_toks") or self.max_gen_toks)
            top_k = int(kw["top_k"]) if kw.get("top_k") else None
            text = self._generate(context, max_new, temp, top_k, until)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
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
