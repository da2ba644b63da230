"""No tests here: kiln.evaluation's tests sit at the mirrored path of the module each exercises (test_adapter.py,
test_tasks.py, test_suite.py, ...), their helpers in evaluation_kit.py. This name stays for the pipeline tests that
import make_docs from it (tests/assets/test_evaluation_assets.py, tests/assets/test_benchmark_assets.py).
"""

from tests.kiln.evaluation.evaluation_kit import make_docs  # noqa: F401
