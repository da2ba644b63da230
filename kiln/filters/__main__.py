"""``python -m kiln.filters FILE``: every quality signal of one file and the first rule that drops it."""

import sys

from kiln.filters.base import main

sys.exit(main(sys.argv[1:]))
