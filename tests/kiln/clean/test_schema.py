"""Tests for kiln.clean.schema: the raw corpus's input columns, the kept corpus (document columns, then the registered
filters' signals, then the stages' own), a shard's two extra columns, and removed.parquet, column by column with their
types; a kept row survives a Parquet round trip with its types.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.clean.schema import (
    CONTENT_TYPES,
    DOC_COLUMNS,
    INPUT_COLUMNS,
    REMOVED_SCHEMA,
    kept_schema,
    shard_schema,
    signal_types,
)
from kiln.filters import registry

DOCUMENT = ["id", "source", "url", "text", "content_type", "bytes", "license", "title"]
STAGES = {"pii_replacements": pa.int64(), "lines_removed": pa.int64(), "token_kl": pa.float64(),
          "quality_score": pa.float64()}


def test_a_raw_corpus_brings_the_document_columns_but_the_title():
    assert INPUT_COLUMNS == ["id", "source", "url", "text", "content_type", "bytes", "license"]
    assert [name for name, _ in DOC_COLUMNS] == DOCUMENT == INPUT_COLUMNS + ["title"]
    assert CONTENT_TYPES == ("text/html", "text/plain")


def test_signals_are_the_filters_then_the_stages_each_once():
    filters = registry.signal_types()
    signals = signal_types()
    assert list(signals) == list(filters) + list(STAGES)
    assert len(signals) == len(filters) + 4  # no stage column shadows a filter's
    assert {k: signals[k] for k in STAGES} == STAGES
    assert all(signals[k] == t for k, t in filters.items())


def test_the_kept_corpus_is_document_columns_then_signals_with_their_types():
    schema = kept_schema()
    assert schema.names == DOCUMENT + list(signal_types())
    assert [schema.field(c).type for c in DOCUMENT] == [pa.string()] * 5 + [pa.int64(), pa.string(), pa.string()]
    assert all(schema.field(k).type == t for k, t in signal_types().items())


def test_a_shard_adds_the_input_size_and_the_minhash_after_the_document_columns():
    shard, kept = shard_schema(), kept_schema()
    assert shard.names == DOCUMENT + ["input_bytes", "minhash"] + list(signal_types())
    assert shard.field("input_bytes").type == pa.int64() and shard.field("minhash").type == pa.binary()
    assert shard.remove(shard.get_field_index("minhash")).remove(shard.get_field_index("input_bytes")) == kept


def test_removed_documents_keep_their_id_reason_and_what_they_duplicate():
    assert REMOVED_SCHEMA.names == ["id", "source", "url", "reason", "bytes", "detail", "duplicate_of"]
    assert [f.type for f in REMOVED_SCHEMA] == [pa.string()] * 4 + [pa.int64(), pa.string(), pa.string()]


def test_a_kept_row_round_trips_through_parquet_with_its_types(tmp_path):
    samples = {pa.string(): "en", pa.int64(): 7, pa.float64(): 0.25}
    row = {"id": "web/0001", "source": "web", "url": "https://example.org/", "text": "Some kept prose.",
           "content_type": "text/html", "bytes": 16, "license": "CC-BY-4.0", "title": "Example",
           **{k: samples.get(t) for k, t in signal_types().items()}}
    pq.write_table(pa.Table.from_pylist([row], schema=kept_schema()), tmp_path / "kept.parquet")
    back = pq.read_table(tmp_path / "kept.parquet")
    assert back.schema.remove_metadata() == kept_schema() and back.to_pylist() == [row]
