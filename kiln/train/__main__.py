"""``python -m kiln.train --config job.json``: run a training job (any task) on this process or under torchrun."""

import sys

from kiln.train.entry import main

main(sys.argv[1:])
