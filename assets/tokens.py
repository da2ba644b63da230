"""Steps 2-3 as assets: the tokenizer and the token shards."""

from dagster import AssetExecutionContext, Config, MetadataValue, Output, asset
from pydantic import Field

from assets._common import commit_output, data_version, md_table, mlflow_meta
from assets.collect import corpus_texts
from kiln import shards as kshards
from kiln import tokenizer as ktok
from kiln.storage import staging_dir
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

TOKENIZER_HOLDOUT_PERMILLE = 50  # documents per thousand kept out of BPE training for the compression report


class TokenizerConfig(Config):
    kind: str = Field(default="bpe", description="'bpe': train a byte-level BPE on the clean corpus; 'gpt2': GPT-2's vocabulary from a pinned package.")
    vocab_size: int = Field(default=4096, description="Vocabulary size of a trained BPE, special tokens included.")
    train_mb: float = Field(default=20.0, description="MB of clean text the BPE trains on (the first documents of the train split).")


@asset(code_version="1", group_name="data")
def tokenizer(context: AssetExecutionContext, config: TokenizerConfig, clean_corpus: dict,
              storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """The tiktoken encoding used everywhere after this step: a BPE trained on the clean corpus, or GPT-2's, with chat special tokens."""
    with mlflow.asset_run(context, params=config.model_dump(), tags={"input.clean_corpus": clean_corpus["version"]}) as run, \
            staging_dir(storage.path("tokenizer")) as stage:
        train_texts, held_out = [], []
        budget = int(config.train_mb * 1e6)
        for doc_id, text in corpus_texts(clean_corpus["path"]):
            if kshards.split_of(doc_id, TOKENIZER_HOLDOUT_PERMILLE) == "val":
                if len(held_out) < 200:
                    held_out.append(text)
            elif budget > 0:
                train_texts.append(text)
                budget -= len(text.encode())
        if config.kind == "bpe":
            enc = ktok.train_bpe(train_texts, config.vocab_size)
        elif config.kind == "gpt2":
            enc = ktok.fetch_gpt2(storage.cache_dir)
        else:
            raise ValueError(f"tokenizer.kind must be 'bpe' or 'gpt2', not {config.kind!r}")
        ktok.save_encoding(enc, stage / "tokenizer.json")
        final, version = commit_output(stage, storage.path("tokenizer"))
        bpt = ktok.bytes_per_token(enc, held_out) if held_out else float("nan")
        run.log_metrics({"n_vocab": enc.n_vocab, "bytes_per_token": bpt})
        sample = held_out[0][:200] if held_out else "Hello world"
        pieces = [enc.decode([t]) for t in enc.encode_ordinary(sample)[:40]]
        value = {"path": str(final / "tokenizer.json"), "version": version, "n_vocab": enc.n_vocab, "kind": config.kind,
                 "bytes_per_token": bpt, "eot": enc.eot_token, "fingerprint": ktok.encoding_fingerprint(enc)}
        return Output(value, data_version=data_version(version), metadata={
            "kind": config.kind, "n_vocab": enc.n_vocab, "bytes_per_token_heldout": bpt,
            "trained_on_mb": round(sum(len(t.encode()) for t in train_texts) / 1e6, 2) if config.kind == "bpe" else 0.0,
            "sample_tokens": MetadataValue.md(" · ".join(f"`{p!r}`" for p in pieces)),
            "path": MetadataValue.path(value["path"]), **mlflow_meta(run),
        })


class TokenShardsConfig(Config):
    shard_tokens: int = Field(default=10_000_000, description="Tokens per shard file (llm.c uses 100M).")
    val_permille: int = Field(default=20, description="Documents per thousand (by a hash of their id) in the fixed validation split.")
    num_workers: int = Field(default=2, description="Encoding processes.")


@asset(code_version="1", group_name="data")
def token_shards(context: AssetExecutionContext, config: TokenShardsConfig, clean_corpus: dict, tokenizer: dict,
                 storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """The clean corpus as llm.c token shards (header + uint16/uint32 tokens, end-of-text between documents), a fixed validation split and a checksummed manifest."""
    enc = ktok.load_encoding(tokenizer["path"])
    with mlflow.asset_run(context, params=config.model_dump(), tags={"input.clean_corpus": clean_corpus["version"],
                                                                      "input.tokenizer": tokenizer["version"]}) as run, \
            staging_dir(storage.path("token_shards")) as stage:
        manifest = kshards.write_shards(enc, corpus_texts(clean_corpus["path"]), stage, config.shard_tokens,
                                        config.val_permille, config.num_workers)
        final, version = commit_output(stage, storage.path("token_shards"))
        totals = manifest["splits"]
        run.log_metrics({f"{s}_tokens": v["tokens"] for s, v in totals.items()})
        value = {"dir": str(final), "version": version, "val_permille": config.val_permille,
                 "train": [str(p) for p in kshards.shard_paths(final, "train")],
                 "val": [str(p) for p in kshards.shard_paths(final, "val")], "totals": totals, "dtype": manifest["dtype"]}
        shards_rows = [{k: s[k] for k in ("file", "split", "tokens", "documents")} | {"sha256": s["sha256"][:16]} for s in manifest["shards"]]
        return Output(value, data_version=data_version(version), metadata={
            "train_tokens": totals["train"]["tokens"], "val_tokens": totals["val"]["tokens"],
            "train_documents": totals["train"]["documents"], "val_documents": totals["val"]["documents"],
            "dtype": manifest["dtype"], "shards": md_table(shards_rows), "path": MetadataValue.path(str(final)),
            **mlflow_meta(run),
        })
