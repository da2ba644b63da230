"""The command line of Step 1 "collect": raw documents from a sources manifest into one Parquet file.

Run: ``python -m kiln.sources MANIFEST OUT.parquet [--cache-dir DIR]``; prints the totals as JSON, or exits 1.
"""

import sys

from kiln.sources.pipeline import main

sys.exit(main(sys.argv[1:]))
