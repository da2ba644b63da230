"""``python -m kiln.sources MANIFEST OUT.parquet``: collect raw documents from a source manifest into Parquet."""

import sys

from kiln.sources.readers import main

sys.exit(main(sys.argv[1:]))
