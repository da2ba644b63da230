"""``python -m kiln.posttrain --config job.json``: run any training job, dispatched by its task (pretrain, sft, dpo, rl)."""

import sys

from kiln.train.entry import main
from kiln.train.preempt import exit_code

sys.exit(exit_code(main(sys.argv[1:])))
