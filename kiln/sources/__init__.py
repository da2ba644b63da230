"""Step 1a, collect: fetch pinned public packages and read local files, WARC and Parquet into raw documents."""
