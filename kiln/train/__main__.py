"""``python -m kiln.train --config job.json``: run a training job (pretraining or SFT) on this process or under torchrun."""

import sys

from kiln.train.loop import main

main(sys.argv[1:])
