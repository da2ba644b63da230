"""The Parquet layouts of the cleaning step: the raw corpus it reads, the shard and kept corpus it writes (document
columns, then one column per stored signal of the registered filters and the stages), and removed.parquet.

``python -c "from kiln.clean.schema import kept_schema; print(kept_schema())"``
"""

from __future__ import annotations

import pyarrow as pa

from kiln.filters import registry

INPUT_COLUMNS = ["id", "source", "url", "text", "content_type", "bytes", "license"]
CONTENT_TYPES = ("text/html", "text/plain")

DOC_COLUMNS = [(c, pa.string()) for c in ("id", "source", "url", "text", "content_type")] + [
    ("bytes", pa.int64()), ("license", pa.string()), ("title", pa.string())]
# signals the cleaning stages write themselves, after the filters' columns
STAGE_SIGNALS: dict[str, pa.DataType] = {
    "pii_replacements": pa.int64(),  # personal data replaced by placeholders (per-document stage)
    "lines_removed": pa.int64(),  # lines removed by corpus-wide line dedup
    "token_kl": pa.float64(),  # KL divergence of the document's words from the corpus's
    "quality_score": pa.float64(),  # the quality classifier's probability of "reference-like"
}
REMOVED_SCHEMA = pa.schema(
    [(c, pa.string()) for c in ("id", "source", "url", "reason")]
    + [("bytes", pa.int64()), ("detail", pa.string()), ("duplicate_of", pa.string())]
)


def signal_types() -> dict[str, pa.DataType]:
    """Every signal column of the kept corpus, in order: the registered filters' stored signals, then the stages'."""
    return {**registry.signal_types(), **STAGE_SIGNALS}


def kept_schema() -> pa.Schema:
    """The clean corpus: document columns and signals."""
    return pa.schema(DOC_COLUMNS + list(signal_types().items()))


def shard_schema() -> pa.Schema:
    """A shard's kept rows: also the raw size and the MinHash signature, for the corpus stage."""
    return pa.schema(DOC_COLUMNS + [("input_bytes", pa.int64()), ("minhash", pa.binary())]
                     + list(signal_types().items()))
