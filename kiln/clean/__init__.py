"""Step 1c, clean: extraction, Unicode repair, filters, PII, dedup, the quality classifier and the mix over a corpus."""
