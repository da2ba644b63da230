"""bench/cross_bpb.py: bits per byte of a model on documents, checked against the loss computed by hand."""

import math

import pytest
import torch
from bench_module import load_bench

from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT


def test_bits_per_byte_is_the_windowed_loss_over_the_bytes(tiny_tokenizer, one_thread):
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=8, n_layer=1, n_head=2, n_embd=16)).eval()
    docs = ["The river runs past the mill.", "A cat sees the dog, naïvely."]  # a two-byte character counts twice
    bpb, n = load_bench("cross_bpb").bits_per_byte(model, enc, docs, window=8)
    ids = [*enc.encode_ordinary(docs[0]), enc.eot_token, *enc.encode_ordinary(docs[1]), enc.eot_token]
    assert n == len(ids) > 9  # more than one window
    nll = 0.0
    with torch.no_grad():
        for i in range(0, len(ids) - 1, 8):  # the same windows, each target scored once
            chunk = torch.tensor(ids[i : i + 9])
            logp = torch.log_softmax(model(chunk[None, :-1])[0].float(), -1)
            nll -= sum(float(logp[t, chunk[t + 1]]) for t in range(len(chunk) - 1))
    nbytes = len(docs[0].encode()) + len(docs[1].encode())
    assert nbytes == len(docs[0]) + len(docs[1]) + 1
    assert bpb == pytest.approx(nll / nbytes / math.log(2), rel=1e-5)
