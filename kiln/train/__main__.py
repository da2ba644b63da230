"""``python -m kiln.train --config job.json``: run a training job (any task) on this process or under torchrun."""

import sys

from kiln.train.entry import main
from kiln.train.preempt import exit_code

sys.exit(exit_code(main(sys.argv[1:])))  # PREEMPTED_EXIT after a stop signal
