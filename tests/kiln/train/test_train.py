"""No tests here: the one-process training tests sit at the mirrored path of the module each exercises (test_trainer.py,
test_loop.py, test_spikes.py, ...). This name stays for tests/resources/test_torchrun.py, which imports
assert_same_final_state from it.
"""

from tests.kiln.train.test_trainer import assert_same_final_state  # noqa: F401
