"""Tiny random Hugging Face models and tokenizers, built with transformers and tokenizers into a folder (no hub).

``save_tiny(folder, "gpt2" | "llama" | "qwen3" | "qwen3_moe", style="gpt2" | "llama3" | "qwen2" | "smollm")`` writes config.json,
model.safetensors (or shards) and tokenizer.json; ``hf_logits(folder, ids)`` runs transformers on it.
"""

from __future__ import annotations

import random
from pathlib import Path

TEXT_WORDS = ("the model reads text and writes tokens ; numbers like 12 345 and 2026 appear , as do names such as "
              "Kiln , Dagster , torch . Café naïve déjà vu — quotes “like this” and code: def f(x): return x * 2 "
              "I'm you're they'll we've 3.14 1,000 ok").split()


def corpus(n: int = 300, seed: int = 0) -> list[str]:
    """Lines of mixed words, digits, punctuation, whitespace runs and non-ASCII text."""
    rng = random.Random(seed)
    seps = [" ", " ", " ", "  ", "\n", "\t", " \n\n"]
    return ["".join(rng.choice(TEXT_WORDS) + rng.choice(seps) for _ in range(rng.randint(3, 25))) for _ in range(n)]


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
SPECIALS = {"gpt2": ["<|endoftext|>"], "llama3": ["<|begin_of_text|>", "<|end_of_text|>"],
            "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "smollm": ["<|endoftext|>", "<|im_start|>"]}


def tiny_tokenizer(style: str = "gpt2", vocab_size: int = 400):
    """A byte-level BPE trained on ``corpus()`` with the pre-tokenizer of ``style``; added tokens after the vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif style in ("llama3", "qwen2"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT if style == "llama3" else QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if style == "qwen2":
            tok.normalizer = normalizers.NFC()
    elif style == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.add_special_tokens(SPECIALS[style])
    return tok


def save_tiny(folder: Path, arch: str = "gpt2", style: str = "", shards: bool = False, seed: int = 0,
              extra_rows: int = 8, license: str = "apache-2.0") -> Path:
    """A random tiny ``arch`` model with its tokenizer (embedding ``extra_rows`` larger than the vocabulary)."""
    import torch
    import transformers as tf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(style or ("gpt2" if arch == "gpt2" else "llama3"))
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size() + extra_rows
    torch.manual_seed(seed)
    eot = tok.token_to_id("<|endoftext|>")
    if arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, bos_token_id=eot, eos_token_id=eot, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
        if arch == "qwen3":
            model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=8, **kw))
        elif arch == "qwen3_moe":  # 4 experts of width 16, 2 per token
            model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=16, norm_topk_prob=True, **kw))
        else:
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    with torch.no_grad():  # random norms and biases too, so a mapping mistake cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # a router transformers starts at zero: random, so routing matters
                p.copy_(0.5 * torch.randn_like(p))
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name or "ln" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder), max_shard_size="40KB" if shards else "5GB")
    (folder / "README.md").write_text(f"---\nlicense: {license}\n---\n# tiny {arch}\n")
    return folder


def hf_logits(folder: Path, ids):
    """(B, T, V) float32 logits of transformers' model saved in ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float()
