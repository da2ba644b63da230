"""Steps 2-3 as assets: the tokenizer (trained with a compression report, or a pretrained model's) and the token shards
(published to the durable root).

Materialize with the pipeline (``kiln run --preset smoke``) or alone: ``kiln run --select tokenizer,token_shards``.
"""

import time
from pathlib import Path
from typing import Annotated, Optional

from dagster import AssetExecutionContext, MetadataValue, Output, asset
from pydantic import Field

from assets._common import asset_output, failing_on_damage, md_table
from assets._config import KilnConfig
from kiln.clean.corpus import corpus_texts
from kiln.tokens import shards as kshards
from kiln.tokens import tokenizer as ktok
from kiln.common.config import Domain
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

TOKENIZER_HOLDOUT_PERMILLE = 50  # documents per thousand kept out of BPE training; a superset of every val split up to 5 %


class TokenizerConfig(KilnConfig):
    kind: str = Field(default="bpe", description="'bpe': train a byte-level BPE on the clean corpus; 'gpt2': GPT-2's vocabulary from a pinned package.")
    vocab_size: Annotated[int, Domain(259)] = Field(default=4096, description="Vocabulary size of a trained BPE, special tokens included.")
    train_mb: Annotated[float, Domain(0, low_open=True)] = Field(default=20.0, description="MB of clean text the BPE trains on (the first documents outside the held-out 5 %).")
    heldout_mb: Annotated[float, Domain(0, low_open=True)] = Field(default=2.0, description="MB of held-out documents (never trained on) on which compression is measured.")
    compare: bool = Field(default=True, description="Also measure the other vocabulary on the same held-out text: GPT-2's for a trained BPE, a BPE of vocab_size for GPT-2.")
    split_digits: bool = Field(default=True, description="Split numbers into single digits before BPE (split pattern's number rule \\p{N}, not GPT-4's \\p{N}{1,3}), so no token spans two digits, as in Llama, PaLM and DeepSeek (the demo's default: RL's held-out arithmetic moves beyond noise with it, bench/results/digit_split.md); false keeps GPT-4's pattern. A trained BPE only: GPT-2's vocabulary keeps its own.")


def imported_tokenizer(context, clean_corpus: dict, pretrained_model: dict, heldout_mb: float,
                       storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """The tokenizer asset when pretrained_model is set: the imported model's own encoding (its ids kept, Kiln's chat
    tokens appended), measured on the same held-out documents a trained BPE would be."""
    with asset_output(context, mlflow, parent=storage.path("tokenizer"),
                      inputs={"clean_corpus": clean_corpus, "pretrained_model": pretrained_model}) as run:
        if run.reused:
            return run.reused
        enc = ktok.load_encoding(pretrained_model["tokenizer"])
        _, held_out = ktok.holdout_split(corpus_texts(clean_corpus["path"]),
                                         lambda doc_id: kshards.split_of(doc_id, TOKENIZER_HOLDOUT_PERMILLE) == "val", 0, heldout_mb)
        bpt = ktok.bytes_per_token(enc, held_out) if held_out else float("nan")
        ktok.save_encoding(enc, run.stage / "tokenizer.json")
        final = run.commit()
        published = storage.publish(final, "tokenizer", run.version, last="tokenizer.json")
        run.log_metrics({"n_vocab": enc.n_vocab, "bytes_per_token": bpt})
        label = f"{pretrained_model['model_type']} from {Path(pretrained_model['source']).name}"
        value = {"path": str(final / "tokenizer.json"), "version": run.version, "n_vocab": enc.n_vocab, "kind": "pretrained",
                 "bytes_per_token": bpt, "compression": {label: bpt}, "eot": enc.eot_token,
                 "fingerprint": ktok.encoding_fingerprint(enc), "url": published.url, "pretrained": pretrained_model["version"]}
        return run.result(value, {
            "kind": "pretrained", "source": MetadataValue.path(pretrained_model["source"]), "n_vocab": enc.n_vocab,
            "bytes_per_token_heldout": bpt, "heldout_documents": len(held_out),
            "added_tokens": MetadataValue.json(pretrained_model["added_tokens"]),
            "path": MetadataValue.path(value["path"]), "durable_copy": published.url,
        })


@asset(code_version="2", group_name="data")  # 2: split_digits
def tokenizer(context: AssetExecutionContext, config: TokenizerConfig, clean_corpus: dict, storage: KilnStorageResource,
              mlflow: MlflowResource, pretrained_model: Optional[dict] = None) -> Output[dict]:
    """The tiktoken encoding used everywhere after this step: a BPE trained on the clean corpus, or GPT-2's, with chat special tokens, its compression on held-out text compared with the other vocabulary's; or the pretrained model's own tokenizer when one is imported."""
    if pretrained_model and pretrained_model["path"]:
        return imported_tokenizer(context, clean_corpus, pretrained_model, config.heldout_mb, storage, mlflow)
    ktok.check_kind(config.kind)
    with asset_output(context, mlflow, parent=storage.path("tokenizer"), config=config,
                      inputs={"clean_corpus": clean_corpus}) as run:
        if run.reused:
            return run.reused
        built = ktok.build_tokenizer(
            corpus_texts(clean_corpus["path"]), lambda doc_id: kshards.split_of(doc_id, TOKENIZER_HOLDOUT_PERMILLE) == "val",
            kind=config.kind, vocab_size=config.vocab_size, train_mb=config.train_mb, heldout_mb=config.heldout_mb,
            compare=config.compare, split_digits=config.split_digits, load_gpt2=lambda: ktok.fetch_gpt2(storage.cache_dir), warn=context.log.warning)
        enc = built.encoding
        ktok.save_encoding(enc, run.stage / "tokenizer.json")
        final = run.commit()
        version = run.version
        published = storage.publish(final, "tokenizer", version, last="tokenizer.json")
        run.log_metrics(built.metrics())
        value = {"path": str(final / "tokenizer.json"), "version": version, "n_vocab": enc.n_vocab, "kind": config.kind,
                 "bytes_per_token": built.bytes_per_token, "compression": built.compression, "eot": enc.eot_token,
                 "fingerprint": ktok.encoding_fingerprint(enc), "url": published.url}
        return run.result(value, {
            "kind": config.kind, "n_vocab": enc.n_vocab, "bytes_per_token_heldout": built.bytes_per_token,
            "bytes_per_token_trained": built.bytes_per_token_trained, "bytes_per_token_gpt2": built.bytes_per_token_gpt2,
            "compression": md_table(built.report), "heldout_documents": built.heldout_documents,
            "trained_on_mb": built.trained_on_mb, "split_pattern": enc._pat_str,
            "sample_tokens": MetadataValue.md(" · ".join(f"`{p!r}`" for p in built.sample_tokens)),
            "path": MetadataValue.path(value["path"]), "durable_copy": published.url,
        })


class TokenShardsConfig(KilnConfig):
    shard_tokens: Annotated[int, Domain(1)] = Field(default=10_000_000, description="Tokens per shard file (llm.c uses 100M).")
    val_permille: Annotated[int, Domain(0, 1000)] = Field(default=50, description="Documents per thousand (by a hash of their id) in the fixed validation split.")
    num_workers: Annotated[int, Domain(1)] = Field(default=2, description="Encoding threads (tiktoken's encoder releases the GIL, so they use as many cores).")


@asset(code_version="1", group_name="data")
def token_shards(context: AssetExecutionContext, config: TokenShardsConfig, clean_corpus: dict, tokenizer: dict,
                 storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """The clean corpus as llm.c token shards (header + uint16/uint32 tokens, end-of-text between documents), a fixed validation split and a checksummed manifest; published to the durable root when it is a URL."""
    with failing_on_damage():  # a tokenizer file failing its fingerprint is set aside: the next run recomputes it
        enc = ktok.load_encoding(storage.local_dir("tokenizer", tokenizer["version"], last="tokenizer.json") / "tokenizer.json")
    with asset_output(context, mlflow, parent=storage.path("token_shards"), config=config,
                      inputs={"clean_corpus": clean_corpus, "tokenizer": tokenizer}) as run:
        if run.reused:
            return run.reused
        t0 = time.perf_counter()
        manifest = kshards.write_shards(enc, corpus_texts(clean_corpus["path"]), run.stage, config.shard_tokens,
                                        config.val_permille, config.num_workers)
        write_s = time.perf_counter() - t0
        final = run.commit()
        version = run.version
        published = storage.publish(final, "token_shards", version)
        local = storage.fetch_shards("token_shards", version)  # reads back what was written: sizes, counts, sha256
        totals = manifest["splits"]
        n_tokens = sum(v["tokens"] for v in totals.values())
        run.log_metrics({**{f"{s}_tokens": v["tokens"] for s, v in totals.items()}, "tokens_per_s": n_tokens / write_s})
        value = {"dir": str(local.dir), "url": published.url, "version": version, "val_permille": config.val_permille,
                 "train": [str(p) for p in kshards.shard_paths(local.dir, "train")],
                 "val": [str(p) for p in kshards.shard_paths(local.dir, "val")], "totals": totals, "dtype": manifest["dtype"]}
        return run.result(value, {
            "train_tokens": totals["train"]["tokens"], "val_tokens": totals["val"]["tokens"],
            "train_documents": totals["train"]["documents"], "val_documents": totals["val"]["documents"],
            "dtype": manifest["dtype"], "tokens_per_s": round(n_tokens / write_s), "shards": md_table(kshards.shard_table(manifest)),
            "path": MetadataValue.path(str(local.dir)), "durable_copy": published.url,
            "uploaded_mb": round(published.bytes / 1e6, 2),
        })
