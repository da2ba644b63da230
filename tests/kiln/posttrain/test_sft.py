"""Tests for kiln.posttrain.sft: the chat template's mask, packing, prompt-masked targets and the resumable loader.

Run: python -m pytest tests/kiln/posttrain/test_sft.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.posttrain.sft import IGNORE, PackedLoader, encode_example, iter_packed_eval, pack, read_pairs, to_xy


def test_encode_example_masks_prompt_and_keeps_response_and_eot(tiny_tokenizer) -> None:
    enc, _ = tiny_tokenizer
    sp = enc._special_tokens
    prompt, response = "What does the cat see?", "The cat sees the river."
    ids, mask = encode_example(enc, prompt, response)
    p, r = enc.encode_ordinary(prompt), enc.encode_ordinary(response)
    assert ids == [sp["<|user|>"], *p, sp["<|assistant|>"], *r, enc.eot_token]
    assert mask == [0] * (len(p) + 2) + [1] * (len(r) + 1)
    assert enc.decode(ids) == f"<|user|>{prompt}<|assistant|>{response}<|endoftext|>"


def ex(n_prompt: int, n_resp: int, tok: int) -> tuple[list[int], list[int]]:
    """A fake example: prompt tokens 100+tok, response tokens tok."""
    return [100 + tok] * n_prompt + [tok] * n_resp, [0] * n_prompt + [1] * n_resp


def test_pack_fills_rows_greedily_and_masks_padding() -> None:
    examples = [ex(2, 3, 1), ex(3, 3, 2), ex(4, 6, 3)]  # lengths 5, 6, 10
    tokens, mask = pack(examples, seq_len=15, pad_id=0)
    assert tokens.shape == mask.shape == (2, 16)
    assert tokens.dtype == np.int64 and mask.dtype == np.uint8
    assert tokens[0].tolist() == [101, 101, 1, 1, 1, 102, 102, 102, 2, 2, 2, 0, 0, 0, 0, 0]
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    assert tokens[1].tolist() == [103] * 4 + [3] * 6 + [0] * 6
    assert mask[1].tolist() == [0] * 4 + [1] * 6 + [0] * 6


def test_pack_exact_fit_and_truncation() -> None:
    tokens, mask = pack([ex(4, 4, 1), ex(4, 4, 2)], seq_len=15, pad_id=0)  # 8 + 8 = 16 fits one row exactly
    assert tokens.shape == (1, 16) and mask.sum() == 8
    tokens, mask = pack([ex(10, 30, 5)], seq_len=15, pad_id=0)  # longer than a row: cut to 16
    assert tokens.tolist() == [[105] * 10 + [5] * 6]
    assert mask.tolist() == [[0] * 10 + [1] * 6]
    with pytest.raises(ValueError, match="no instruction examples"):
        pack([], 15, 0)


def test_to_xy_ignores_exactly_prompt_and_padding_targets(tiny_tokenizer) -> None:
    enc, _ = tiny_tokenizer
    exs = [encode_example(enc, "Explain the river.", "The river runs to the sea."),
           encode_example(enc, "What is 2 + 3?", "2 + 3 = 5.")]
    tokens, mask = pack(exs, seq_len=63, pad_id=enc.eot_token)
    x, y = to_xy(tokens, mask)
    assert x.shape == y.shape == (tokens.shape[0], 63)
    assert torch.equal(x, torch.from_numpy(tokens[:, :-1]))
    target_is_response = torch.from_numpy(mask[:, 1:]).bool()
    assert torch.equal(y == IGNORE, ~target_is_response)
    assert torch.equal(y[target_is_response], torch.from_numpy(tokens[:, 1:])[target_is_response])
    # both examples share one row: the second <|user|> marker and the padding eots are never targets,
    # each response's own eot is
    assert tokens.shape[0] == 1 and tokens[0].tolist().count(enc._special_tokens["<|user|>"]) == 2
    row0 = y[0].tolist()
    assert enc._special_tokens["<|user|>"] not in row0
    assert row0.count(enc.eot_token) == 2
    assert tokens[0, -1] == enc.eot_token and row0[-1] == IGNORE  # padding


def test_loss_gradient_is_exactly_zero_on_prompt_positions(tiny_tokenizer) -> None:
    enc, _ = tiny_tokenizer
    tokens, mask = pack([encode_example(enc, "Explain the long road.", "The road runs to a quiet village."),
                         encode_example(enc, "Who paints the tree?", "My sister paints the tree.")],
                        seq_len=31, pad_id=enc.eot_token)
    x, y = to_xy(tokens, mask)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32))
    logits = model(x)  # (B, T, V)
    logits.retain_grad()
    F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE).backward()
    ignored = y == IGNORE  # (B, T)
    assert ignored.any() and (~ignored).any()
    assert torch.count_nonzero(logits.grad[ignored]) == 0
    assert bool((logits.grad[~ignored].abs().sum(-1) > 0).all())


def rows(n: int, width: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """n packed rows whose first token is the row's index, so batches say which rows they hold."""
    tokens = np.tile(np.arange(width, dtype=np.int64), (n, 1)) + 1000
    tokens[:, 0] = np.arange(n)
    mask = np.ones((n, width), dtype=np.uint8)
    return tokens, mask


def row_ids(batch) -> list[int]:
    return batch[0][:, 0].tolist()


def test_packed_loader_is_deterministic_and_shuffles_per_epoch() -> None:
    tokens, mask = rows(20)
    a, b = PackedLoader(tokens, mask, 4, seed=3), PackedLoader(tokens, mask, 4, seed=3)
    ea = [row_ids(a.next_batch()) for _ in range(10)]  # 5 batches per epoch: two epochs
    assert ea == [row_ids(b.next_batch()) for _ in range(10)]
    first, second = sum(ea[:5], []), sum(ea[5:], [])
    assert sorted(first) == sorted(second) == list(range(20))  # each epoch visits every row once
    assert first != second  # and in a new order
    other = PackedLoader(tokens, mask, 4, seed=4)
    assert [row_ids(other.next_batch()) for _ in range(5)] != ea[:5]


@pytest.mark.parametrize("consumed", [0, 3, 5, 7])  # 5 = exactly at an epoch boundary
def test_packed_loader_resumes_from_state_dict(consumed) -> None:
    tokens, mask = rows(22)  # 5 batches of 4 per epoch, 2 rows left over
    ref = PackedLoader(tokens, mask, 4, seed=1)
    for _ in range(consumed):
        ref.next_batch()
    state = json.loads(json.dumps(ref.state_dict()))  # plain values: survives JSON and weights_only loads
    resumed = PackedLoader(tokens, mask, 4, seed=1)
    resumed.load_state_dict(state)
    for _ in range(6):
        xa, ya = ref.next_batch()
        xb, yb = resumed.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_packed_loader_ranks_are_disjoint_and_cover_the_epoch() -> None:
    tokens, mask = rows(24)
    r0 = PackedLoader(tokens, mask, 3, rank=0, world_size=2, seed=5)
    r1 = PackedLoader(tokens, mask, 3, rank=1, world_size=2, seed=5)
    assert r0.batches_per_epoch == 4
    seen: list[int] = []
    for _ in range(4):
        a, b = row_ids(r0.next_batch()), row_ids(r1.next_batch())
        assert len(a) == len(b) == 3 and not set(a) & set(b)
        seen += a + b
    assert sorted(seen) == list(range(24))


def test_packed_loader_errors_name_the_problem() -> None:
    tokens, mask = rows(5)
    with pytest.raises(ValueError, match="5 packed rows cannot fill one global batch of 6 rows"):
        PackedLoader(tokens, mask, 3, rank=0, world_size=2)
    loader = PackedLoader(*rows(12), 2, world_size=2)
    with pytest.raises(ValueError, match="global batch 8, now 4"):
        loader.load_state_dict({"epoch": 0, "batch": 1, "seed": 0, "global_batch": 8})


def test_iter_packed_eval_is_ordered_and_bounded() -> None:
    tokens, mask = rows(10)
    batches = list(iter_packed_eval(tokens, mask, batch_size=4, max_batches=2))
    assert [row_ids(b) for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [row_ids(b) for b in iter_packed_eval(tokens, mask, 4, 10)][-1] == [8, 9]


def test_read_pairs_filters_split_and_names_bad_lines(tmp_path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "response": "b", "split": "train"}\n\n'
                    '{"prompt": "c", "response": "d", "split": "val"}\n')
    assert [r["prompt"] for r in read_pairs(path)] == ["a", "c"]
    assert [r["prompt"] for r in read_pairs(path, "val")] == ["c"]
    path.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"pairs\.jsonl:2: not valid JSON"):
        read_pairs(path)


def test_pad_rows_keeps_one_example_per_row_and_trim_drops_only_unused_columns() -> None:
    from kiln.posttrain.sft import pad_rows, trim_padding

    tokens, mask = pad_rows([ex(2, 3, 1), ex(1, 1, 2)], seq_len=15, pad_id=0)
    assert tokens.tolist() == [[101, 101, 1, 1, 1], [102, 2, 0, 0, 0]]  # padded to the longest, not to seq_len
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    tokens, _ = pad_rows([ex(10, 30, 5)], seq_len=15, pad_id=0)
    assert tokens.shape == (1, 16)  # cut to seq_len + 1
    x, y = to_xy(*pad_rows([ex(2, 2, 1), ex(2, 5, 2)], seq_len=15, pad_id=0))
    tx, ty = trim_padding(x[:1], y[:1])  # the first row alone: its last target is at column 2
    assert tx.tolist() == [[101, 101, 1]] and ty.tolist() == [[IGNORE, 1, 1]]
    with pytest.raises(ValueError, match="no examples"):
        pad_rows([], 15, 0)
