"""Shared fixtures (used by core, resource and pipeline tests): a tiny BPE, token shards and tiny training job files,
and the session's one smoke pipeline home.

Everything here is small enough for CPU (vocab 300, width 32-64, seq 32); only the smoke-home fixture imports Dagster,
inside itself, so core tests never load it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the project root
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# tests/ and tests/kiln/** are packages (tests.kiln.common.test_config beside tests/assets/test_config.py); the helpers
# beside the tests (ports, procs, textgen, hfmodels, bench_module) still import by bare name: tests/ goes last on the
# path, after the project root, so that `kiln` stays the project's package and not tests/kiln
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))

from kiln.model.config import padded_vocab  # noqa: E402
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one torch thread each, not two fighting threads
    import torch

    torch.set_num_threads(1)

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the farmer", "a small bird", "the teacher", "our neighbour"]
VERBS = ["sees", "likes", "walks to", "finds", "carries", "remembers", "paints", "follows"]
OBJECTS = ["the river", "a red house", "the green field", "an apple", "the long road", "a quiet village",
           "the market", "the tall tree"]
ADVERBS = ["today", "every morning", "in the rain", "slowly", "at night", "with care"]


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ADVERBS)}."


def make_docs(n: int = 500, seed: int = 0) -> list[tuple[str, str]]:
    """(doc id, text) pairs of 3-8 sentences from a small English grammar (learnable by a tiny model)."""
    rng = random.Random(seed)
    return [(f"doc{i:04d}", " ".join(sentence(rng) for _ in range(rng.randint(3, 8)))) for i in range(n)]


@contextlib.contextmanager
def single_thread():
    """torch on one thread inside the block (as the training subprocesses run, OMP_NUM_THREADS=1: another thread count
    sums matmuls in another order), the thread count restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and do not fight other tests for cores)."""
    with single_thread():
        yield


@pytest.fixture(scope="session")
def source_cache(tmp_path_factory) -> Path:
    """Where the smoke preset's packages are fetched once per test run: /tmp/srccache when a developer keeps them there,
    else beside the run's temporary folders, one cache for both xdist workers (a fetch commits its folder atomically,
    so two workers fetching the same package keep one copy)."""
    kept = Path("/tmp/srccache")
    if kept.is_dir():
        return kept
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "source-cache"


@pytest.fixture(scope="session")
def mlflow_ui_port() -> int:
    """The port the UI tests serve ``mlflow ui`` on, chosen before the smoke run so that its links point there."""
    from ports import free_port

    return free_port()


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, source_cache, mlflow_ui_port):
    """(home, Definitions, DagsterInstance, result): the smoke preset through every asset, once per session, on a
    persistent Dagster instance in ``home/dagster`` (what ``kiln run`` writes and the Dagster UI reads, the UI tests
    serve it) with MLflow links to ``mlflow_ui_port``. tests/test_e2e.py checks it and reruns parts of it;
    tests/ui/test_dagster_ui.py browses it (the two files are one xdist work unit, so one worker makes it)."""
    from dagster import DagsterInstance

    from jobs.presets import load_preset
    from jobs.definitions import make_definitions, make_resources
    from jobs.home import record_preset

    home = tmp_path_factory.mktemp("kiln-home")
    (home / "dagster").mkdir()
    (home / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    bound = make_resources(home)["mlflow"]
    mlflow = type(bound)(**{**bound.model_dump(), "ui_url": f"http://127.0.0.1:{mlflow_ui_port}"})
    defs = make_definitions(home, str(source_cache), mlflow=mlflow)
    instance = DagsterInstance.from_config(str(home / "dagster"))
    result = defs.resolve_job_def("kiln_pipeline_job").execute_in_process(
        run_config=load_preset("smoke"), instance=instance, raise_on_error=True)
    record_preset(home, "smoke", load_preset("smoke"))  # as kiln run does: the UI's launchpad opens with it
    yield home, defs, instance, result
    instance.dispose()


@pytest.fixture(scope="session")
def docs() -> list[tuple[str, str]]:
    return make_docs()


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory, docs):
    """(encoding, path of its tokenizer.json): a 300-token BPE with <|endoftext|>, <|user|>, <|assistant|>."""
    from kiln.tokens.tokenizer import save_encoding, train_bpe

    enc = train_bpe((t for _, t in docs), 300)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_encoding(enc, path)
    return enc, path


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory, tiny_tokenizer, docs) -> Path:
    """A folder of train/val token shards (20% of documents in val) with its manifest."""
    from kiln.tokens.shards import write_shards

    enc, _ = tiny_tokenizer
    out = tmp_path_factory.mktemp("shards")
    write_shards(enc, docs, out, shard_tokens=16384, val_permille=200, num_workers=1)
    return out


@pytest.fixture(scope="session")
def model_dict(tiny_tokenizer) -> dict:
    """ModelConfig fields for the tiny training jobs (vocabulary padded from the tokenizer's)."""
    enc, _ = tiny_tokenizer
    return {"vocab_size": padded_vocab(enc.n_vocab), "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 48,
            "dropout": 0.1}  # dropout makes the bit-exact resume test depend on the restored RNG state


@pytest.fixture(scope="session")
def pretrain_job(tiny_tokenizer, tiny_shards, model_dict):
    """Factory: write a pretraining job JSON into ``out_dir`` (overrides as keyword arguments)."""
    from kiln.tokens.shards import shard_paths

    _, tok_path = tiny_tokenizer

    def make(out_dir: Path, **overrides) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        job = {
            "task": "pretrain",
            "out_dir": str(out_dir / "run"),
            "tokenizer": str(tok_path),
            "model": dict(model_dict),
            "optim": {"lr": 1e-2, "warmup_steps": 5, "weight_decay": 0.0},
            "train_files": [str(p) for p in shard_paths(tiny_shards, "train")],
            "val_files": [str(p) for p in shard_paths(tiny_shards, "val")],
            "seq_len": 32,
            "micro_batch": 4,
            "grad_accum": 1,
            "max_steps": 30,
            "eval_interval": 10,
            "eval_batches": 4,
            "ckpt_interval": 10,
            "keep_last": 2,
            "log_interval": 10,
            "seed": 1234,
        }
        job.update(overrides)
        path = out_dir / "job.json"
        path.write_text(json.dumps(job, indent=2))
        return path

    return make


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


def run_train(config: Path, nproc: int = 1, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m kiln.train --config config --device cpu``; with nproc > 1, under torch.distributed.run."""
    args = ["-m", "kiln.train", "--config", str(config), "--device", "cpu", "--timeout-s", "120"]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def train_runner():
    return run_train


# the job overrides of each optimizer the resume tests run: the tiny jobs' AdamW, and Muon with decay and wsd
OPTIMS = {"adamw": {}, "muon": {"optim": {"name": "muon", "lr": 1e-2, "warmup_steps": 5, "weight_decay": 0.1,
                                          "schedule": "wsd"}}}


class LineReporter:
    """A training reporter that keeps the lines it is given (what the CLI prints)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.warnings: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)

    def warning(self, message: str) -> None:
        self.warnings.append(message)


@pytest.fixture(scope="session")
def baselines(tmp_path_factory, pretrain_job):
    """``baselines(name)``: one uninterrupted 30-step run of the tiny job with optimizer ``name`` (OPTIMS), made once
    per session, in-process on one thread (bit-identical to a subprocess run): (job path, the lines it logged)."""
    from kiln.train.loop import main

    runs: dict[str, tuple[Path, str]] = {}

    def get(name: str) -> tuple[Path, str]:
        if name not in runs:
            job, rep = pretrain_job(tmp_path_factory.mktemp(f"baseline-{name}"), **OPTIMS[name]), LineReporter()
            with single_thread():
                main(["--config", str(job), "--device", "cpu"], reporter=rep)
            runs[name] = job, "\n".join(rep.lines)
        return runs[name]

    return get


@pytest.fixture(scope="session")
def baseline(baselines):
    """The uninterrupted 30-step AdamW run: (job path, the lines it logged)."""
    return baselines("adamw")


RAY_CLUSTERS: list = []  # the session's cluster while it runs
LAST_RAY_TEST: list[str] = []  # the node id of the last test (in run order) that uses it


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray cluster on 127.0.0.1 (tests/ray_cluster.py: a head node and a second worker node, one CPU and a
    small object store each), started once per session by the first test that asks for it, stopped after the last
    (its twenty-odd daemons would otherwise take CPU from every later test)."""
    from ray_cluster import RayCluster

    cluster = RayCluster(workers=1)
    RAY_CLUSTERS.append(cluster)
    try:
        cluster.start()
        yield cluster
    finally:
        stop_ray()


def stop_ray() -> None:
    while RAY_CLUSTERS:
        RAY_CLUSTERS.pop().stop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    if LAST_RAY_TEST and item.nodeid == LAST_RAY_TEST[0]:
        stop_ray()


# A test skipped because something it needs is not installed ("... is not installed (apt-get install X)") fails
# the run unless KILN_ALLOW_SKIPS=1: the README's test command (make test) runs every test or says what is missing.
MISSING_DEPENDENCY = ("not installed", "apt-get install", "could not import")
MISSING_SKIPS: list[str] = []  # "test id: reason" of each such skip in this session


def pytest_runtest_logreport(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if any(s in reason for s in MISSING_DEPENDENCY):
            MISSING_SKIPS.append(f"{report.nodeid}: {reason}")


def skips_fail() -> bool:
    return bool(MISSING_SKIPS) and os.environ.get("KILN_ALLOW_SKIPS") != "1"


def pytest_sessionfinish(session, exitstatus) -> None:
    if exitstatus == 0 and skips_fail():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if skips_fail():
        reasons = sorted({m.split(": ", 1)[1] for m in MISSING_SKIPS})
        terminalreporter.write_line(f"kiln: {len(MISSING_SKIPS)} test(s) skipped for a missing dependency, so this run "
                                    f"fails: {'; '.join(reasons)}. Run bash scripts/test-deps.sh as root (it installs "
                                    "them), or set KILN_ALLOW_SKIPS=1 to allow the skips.", red=True)


# Under pytest-xdist (`make test` runs `-n 2`) the tests of one file run on one worker, in file order, so a module
# fixture (the pretrained pipeline of tests/test_e2e_pretrained.py, say) is made once; the files named test_ray*.py,
# which share the session's Ray cluster, run on one worker together, and so do the two files that use the session's
# smoke home (SMOKE_HOME_FILES). The slowest files (measured with --durations) are handed out
# first, so neither worker is left with one of them at the end. (xdist's own `loadgroup` cannot be used: it renames
# node ids, which pytest 9 no longer allows, so its groups are silently ignored.)
SMOKE_HOME_FILES = ("tests/test_e2e.py", "tests/ui/test_dagster_ui.py")
SLOWEST_FIRST = ("smoke", "ray", "tests/test_e2e_pretrained.py",
                 "tests/kiln/train/test_train_distributed.py", "tests/resources/test_torchrun.py",
                 "tests/kiln/train/test_trainer.py", "tests/resources/test_slurm.py")


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: "ray" for the test_ray*.py files, "smoke" for SMOKE_HOME_FILES, else its file."""
    path = nodeid.split("::")[0]
    if path in SMOKE_HOME_FILES:
        return "smoke"
    return "ray" if Path(path).name.startswith("test_ray") else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # keep the order the workers collected (SLOWEST_FIRST)
    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {g: n for n, g in enumerate(SLOWEST_FIRST)}
        first_seen: dict[str, int] = {}
        for n, item in enumerate(items):
            first_seen.setdefault(work_unit(item.nodeid), n)
        items.sort(key=lambda i: (rank.get(work_unit(i.nodeid), len(rank)), first_seen[work_unit(i.nodeid)]))
    users = [i.nodeid for i in items if "ray_cluster" in getattr(i, "fixturenames", ())]
    LAST_RAY_TEST[:] = users[-1:]
