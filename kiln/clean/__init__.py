"""Step 1c, clean: extraction, Unicode repair, filters, PII, dedup, the quality classifier and the mix over a corpus.

config (CleanConfig) -> shard (the per-document stage, per shard) -> corpus (the corpus-wide passes) -> report;
``kiln.clean.run.clean`` runs both stages in one call; schema holds the Parquet layouts.
"""
