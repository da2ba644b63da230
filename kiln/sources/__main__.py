"""``python -m kiln.sources MANIFEST OUT.parquet [--cache-dir DIR]``: collect raw documents from a source manifest into Parquet.

Run: ``python -m kiln.sources conf/sources/demo.yaml raw.parquet``; it prints the totals as JSON (exit 1 on a bad source).
"""

import sys

from kiln.sources.pipeline import main

sys.exit(main(sys.argv[1:]))
