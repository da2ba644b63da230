"""KilnLM's request progress (kiln.evaluation.adapter.RequestProgress): lines with requests done of total, the rate
and the time left, from where the adapter answers lm-eval's requests.

Run: python -m pytest -q tests/kiln/evaluation/test_adapter_progress.py   (tiny model, CPU, a few seconds)
"""

import re

import tiktoken
import torch
from lm_eval.api.instance import Instance

from kiln.evaluation.adapter import KilnLM, RequestProgress
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT

PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_encoding() -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)}
    return tiktoken.Encoding(name="t", pat_str=PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256})


def test_progress_lines_give_done_of_total_rate_and_time_left():
    now = [100.0]
    lines: list[str] = []
    tell = RequestProgress(lines.append, "loglikelihood", 400, every_s=5.0, clock=lambda: now[0])
    for done, t in ((40, 102.0), (80, 104.0), (120, 107.0), (400, 108.0)):
        now[0] = t
        tell.reached(done)
    # the first update, then 120 (5 s after the last line; 80 came 2 s after 40), then the last
    assert lines == ["eval 40/400: loglikelihood | 20.0 requests/s | 18s left",
                     "eval 120/400: loglikelihood | 17.1 requests/s | 16s left",
                     "eval 400/400: loglikelihood | 50.0 requests/s | 0s left"]
    RequestProgress(None, "loglikelihood", 10).reached(5)  # no sink: nothing to do


def test_the_adapter_reports_each_request_type_to_the_last_request():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    lines: list[str] = []
    lm = KilnLM(model, byte_encoding(), batch_size=2, progress=lines.append)
    reqs = [Instance("loglikelihood", {}, (f"question {i}", f" answer {i % 3}"), 0) for i in range(7)]
    lm.loglikelihood(reqs)
    lm.generate_until([Instance("generate_until", {}, (f"q{i}", {"max_gen_toks": 2}), 0) for i in range(5)])
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("some text to score",), 0)])
    assert lines[0].startswith("eval ") and lines[0].split(":")[1].startswith(" loglikelihood |")
    ends = [ln.split(" |")[0] for ln in lines if re.match(r"eval (\d+)/\1:", ln)]  # each call's last line
    assert ends == ["eval 7/7: loglikelihood", "eval 5/5: generate_until", "eval 1/1: loglikelihood_rolling"]
    assert all(ln.endswith(" left") and " requests/s | " in ln for ln in lines)
