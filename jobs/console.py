"""What ``kiln run`` shows a person: one line as each asset starts and ends, live progress bars, actionable warnings.

``RunConsole(log_path)`` is a Dagster logger (``job.with_logger_defs(console.logger_defs())``, run config
``console.loggers_config()``) that writes every event to ``log_path`` and shows the few that matter: asset start and end
(time taken and one or two headline figures), training progress as a rich bar (plain lines when not a terminal or
under CI), warnings and failures. ``kiln run --verbose`` keeps Dagster's own console log as well.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, TextIO

# "step 20/60: loss 4.1234 | val 4.3 | ... | 3,100 tok/s | ... | 40s left" (kiln.train.Stage.progress, every stage) and
# "eval 120/400: loglikelihood | 35.2 requests/s | 8s left" (kiln.evaluation.adapter.RequestProgress)
PROGRESS = re.compile(r"^(step|eval) (\d+)/(\d+): (.*)$")
# The figures a progress line keeps on screen, in the order given, as many as fit (the event log has them all):
# fields starting with one of these, and rates (ending in "/s"); the time left has its own column.
KEY_FIGURES = ("loss", "val ", "reward", "margin", "held-out", "loglikelihood", "generate")
WIDTH = 80  # columns a plain progress line keeps within
# The figures shown when an asset ends: (metadata key, template); those present are printed.
FIGURES: dict[str, list[tuple[str, str]]] = {
    "raw_documents": [("documents", "{:,} documents"), ("bytes", "{:,} bytes")],
    "clean_corpus": [("kept_documents", "kept {:,} documents"), ("dropped_documents", "dropped {:,}")],
    "tokenizer": [("n_vocab", "{:,} tokens"), ("bytes_per_token_heldout", "{:.2f} bytes/token held out")],
    "token_shards": [("train_tokens", "{:,} train tokens"), ("val_tokens", "{:,} validation")],
    "training_plan": [("parameters", "{:,} parameters"), ("total_tokens", "{:,} tokens to train")],
    "base_model": [("final_val_loss", "validation loss {:.3f}"), ("tokens_per_s", "{:,.0f} tokens/s")],
    "eval_suite": [("held_out_documents", "from {:,} held-out documents")],
    "contamination_report": [("worst_share", "worst task {:.0%} contaminated")],
    "eval_scores": [("val_bits_per_byte", "{:.3f} bits/byte")],
    "instruction_data": [("pairs", "{:,} pairs")],
    "preference_data": [("pairs", "{:,} pairs")],
    "sft_model": [("final_val_loss", "response loss {:.3f}"), ("steps", "{:,} steps")],
    "dpo_model": [("held_out_reward_accuracy", "held-out reward accuracy {:.2f}"), ("steps", "{:,} steps")],
    "rl_model": [("final_held_out_reward", "held-out reward {:.3f}"), ("steps", "{:,} steps")],
    "reward_model": [("held_out_accuracy", "held-out pair accuracy {:.2f}"), ("steps", "{:,} steps")],
    "ppo_model": [("final_held_out_reward", "held-out reward {:.3f}"), ("steps", "{:,} steps")],
    "release_bundle": [("bytes", "{:,} bytes")],
}
# Loggers of libraries whose INFO lines are for their developers, not for a person running Kiln.
NOISY_LOGGERS = ("mlflow", "alembic", "lm_eval", "lm-eval", "httpx", "urllib3", "filelock", "matplotlib", "numexpr")


def asset_of(step_key: str | None) -> str:
    """The asset a step belongs to: ``clean_corpus.clean_shard[s00001]`` -> ``clean_corpus``."""
    return (step_key or "").split(".", 1)[0].split("[", 1)[0]


def plain_output() -> bool:
    """Plain lines instead of live bars: stdout is not a terminal, or CI / TERM=dumb says so."""
    return not sys.stdout.isatty() or bool(os.environ.get("CI")) or os.environ.get("TERM") == "dumb"


def _value(v: Any) -> Any:
    return getattr(v, "value", v)  # a Dagster MetadataValue holds it in .value


def headline(asset: str, metadata: dict[str, Any]) -> str:
    """The asset's one or two figures that matter, from its materialization metadata ('' when none is there)."""
    parts = []
    for key, template in FIGURES.get(asset, []):
        if key in metadata:
            v = _value(metadata[key])
            try:
                parts.append(template.format(v))
            except (ValueError, TypeError):  # not the type the template expects
                parts.append(f"{key} {v}")
    return ", ".join(parts)


def fit_status(status: str, room: int) -> tuple[str, str]:
    """(the key figures of a progress line's status, as many as fit in ``room`` columns; its time left)."""
    fields = [f.strip() for f in status.split("|")]
    left = next((f for f in fields if f.endswith(" left")), "")
    keep = [f for f in fields if f.startswith(KEY_FIGURES) or f.endswith("/s")] or [f for f in fields if f != left][:1]
    while len(keep) > 1 and len("  ".join(keep)) > room:
        keep.pop()
    return "  ".join(keep)[:max(room, 0)], left


def bar_width(columns: int) -> int:
    """The bar's width on a terminal ``columns`` wide: 30, narrower below 100 columns to leave the figures room."""
    return max(10, min(30, columns - 70))


def bar_room(columns: int, asset: str, total: int, status: str) -> int:
    """Columns left for the figures on a bar's line: the name, bar, N/M, elapsed time (7) and time left take the
    rest, with a space between columns."""
    left = fit_status(status, 0)[1]
    used = len(f"  {asset:<12}") + bar_width(columns) + 2 * len(str(total)) + 1 + 7 + len(left) + 5
    return columns - used - 1


def format_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


class RunConsole:
    """Turns the Dagster event stream of one ``kiln run`` into lines for people (and all of it into ``log_path``)."""

    def __init__(self, log_path: Path, assets: list[str], stream: TextIO | None = None, plain: bool | None = None,
                 verbose: bool = False):
        self.log_path, self.assets, self.verbose = Path(log_path), set(assets), verbose
        self.stream = stream or sys.stdout
        self.plain = plain_output() if plain is None else plain
        self.started: dict[str, float] = {}  # asset -> monotonic start
        self.done: set[str] = set()
        self.bars: dict[str, Any] = {}  # asset -> rich task id, or last plain progress print time
        self._progress = None
        self.failed: list[str] = []
        self._files: list[logging.FileHandler] = []

    # -- setup

    def logger_defs(self) -> dict[str, Any]:
        """Dagster logger definitions: ``kiln`` (this console) and ``console`` (Dagster's own, for --verbose)."""
        from dagster import LoggerDefinition
        from dagster._loggers import colored_console_logger

        return {"kiln": LoggerDefinition(lambda _ctx: self._logger(), description="kiln run's console and log file"),
                "console": colored_console_logger}

    def loggers_config(self) -> dict[str, Any]:
        return {"kiln": {}, **({"console": {"config": {"log_level": "DEBUG"}}} if self.verbose else {})}

    def _logger(self) -> logging.Logger:
        log = logging.Logger("kiln.run", logging.DEBUG)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(self.log_path, encoding="utf-8")
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self._files.append(file)  # closed when the console ends (kiln sweep makes one logger per run)
        log.addHandler(file)
        log.addHandler(_Relay(self.handle))
        return log

    def __enter__(self) -> "RunConsole":
        if not self.verbose:
            for name in NOISY_LOGGERS:
                logging.getLogger(name).setLevel(logging.WARNING)
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            quiet_dependency_warnings(self._log_warning)
        return self

    def _bars(self):
        """The live progress display, started with the first bar (and stopped when the last one ends)."""
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(file=self.stream)
            self._progress = Progress(TextColumn("  {task.description:<12}"), BarColumn(bar_width=bar_width(console.width)),
                                      MofNCompleteColumn(), TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                      TextColumn("{task.fields[left]}"), console=console,
                                      transient=True, redirect_stdout=False, redirect_stderr=False)
            self._progress.start()
        return self._progress

    def __exit__(self, *exc) -> None:
        for file in self._files:
            file.close()
        self._files.clear()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if not self.verbose:
            self._warnings.__exit__(*exc)

    def say(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    def _log_warning(self, line: str) -> None:
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} WARNING {line}\n")

    # -- events

    def handle(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "dagster_meta", None) or {}
        event = meta.get("dagster_event")
        asset = asset_of(meta.get("step_key"))
        if event is not None:
            self._event(event, asset)
        elif record.levelno >= logging.WARNING:
            self.say(f"  ! {asset + ': ' if asset else ''}{meta.get('orig_message', record.getMessage())}")
        else:
            match = PROGRESS.match(meta.get("orig_message", ""))
            if match and asset:
                self._step(asset, int(match[2]), int(match[3]), match[4], match[1])

    def _event(self, event, asset: str) -> None:
        kind = event.event_type_value
        if kind == "STEP_START" and asset in self.assets and (asset not in self.started or asset in self.done):
            self.started[asset] = time.monotonic()  # (again for an asset done before: kiln sweep's next point)
            self.done.discard(asset)
            self.bars.pop(asset, None)
            self.say(f"▶ {asset}")
            if not self.plain:  # a pulsing bar with the time so far, until progress lines give it steps
                self.bars[asset] = self._bars().add_task(asset, total=None, status="", left="")
        elif kind == "ASSET_MATERIALIZATION":
            mat = event.event_specific_data.materialization
            self._finished(mat.asset_key.to_user_string(), dict(mat.metadata))
        elif kind == "STEP_FAILURE" and asset not in self.failed:
            self.failed.append(asset)
            self._end_bar(asset)
            took = time.monotonic() - self.started.get(asset, time.monotonic())
            self.say(f"✗ {asset} failed after {format_seconds(took)} (why: below)")
        elif kind == "ASSET_CHECK_EVALUATION":
            check = event.event_specific_data
            if not check.passed:
                why = "".join(f"\n      {line}" for line in (check.description or "").split("; ") if line)
                self.say(f"  ! check {check.check_name} on {check.asset_key.to_user_string()} failed{':' if why else ''}{why}")

    def _finished(self, asset: str, metadata: dict[str, Any]) -> None:
        self._end_bar(asset)
        self.done.add(asset)
        took = time.monotonic() - self.started.get(asset, time.monotonic())
        reused = " reused" if "reused_mlflow_run_id" in metadata else ""
        figures = headline(asset, metadata)
        self.say(f"✓ {asset:<20} {format_seconds(took):>6}{reused}{'  ' + figures if figures else ''}")

    def _step(self, asset: str, step: int, total: int, status: str, unit: str = "step") -> None:
        if not self.plain:
            bars = self._bars()
            short, left = fit_status(status, bar_room(bars.console.width, asset, total, status))
            if asset not in self.bars:
                self.bars[asset] = bars.add_task(asset, total=total, status="", left="")
            bars.update(self.bars[asset], completed=step, total=total, status=short, left=left)
            return
        now = time.monotonic()
        if step == total or now - self.bars.get(asset, 0.0) >= 30 or asset not in self.bars:
            self.bars[asset] = now
            head = f"  {asset} {unit} {step}/{total}  "
            left = fit_status(status, WIDTH)[1]
            short = fit_status(status, WIDTH - len(head) - (len(left) + 2 if left else 0))[0]
            self.say(f"{head}{short}{'  ' + left if left else ''}")

    def _end_bar(self, asset: str) -> None:
        if asset not in self.bars:
            return
        task = self.bars.pop(asset)
        if self._progress is not None:
            self._progress.remove_task(task)
            if not self._progress.tasks:
                self._progress.stop()
                self._progress = None


class _Relay(logging.Handler):
    def __init__(self, fn: Callable[[logging.LogRecord], None]):
        super().__init__(logging.DEBUG)
        self.fn = fn

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.fn(record)
        except Exception:  # a display problem must never fail the run
            self.handleError(record)


def quiet_dependency_warnings(log: Callable[[str], None]) -> None:
    """Warnings a person running Kiln cannot act on (Dagster's beta/preview notes, deprecations inside libraries) go
    to ``log`` only; a warning raised from Kiln's own code, or any other kind, still shows once."""
    from dagster import BetaWarning, PreviewWarning

    try:
        from dagster import SupersessionWarning
    except ImportError:  # older Dagster
        SupersessionWarning = BetaWarning  # noqa: N806
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = f"{category.__name__}: {message} ({filename}:{lineno})"
        log(text)
        library = not str(filename).startswith(str(Path(__file__).resolve().parent.parent)) or "site-packages" in str(filename)
        if issubclass(category, (BetaWarning, PreviewWarning, SupersessionWarning)) or (
                library and issubclass(category, (DeprecationWarning, FutureWarning, PendingDeprecationWarning))):
            return
        shown(message, category, filename, lineno, file, line)

    warnings.simplefilter("default")
    warnings.showwarning = show


def score_line(task: str, row: dict[str, Any]) -> str:
    """One task's primary score as ``acc_norm 0.150 ± 0.082 (chance 0.25, 20 items)``."""
    from kiln.release.card import task_score

    s = task_score(task, row)
    if s is None:
        return "no score"
    err = f" ± {s['stderr']:.3f}" if s["stderr"] is not None else ""
    chance = f"chance {s['chance']:.2f}, " if s["chance"] is not None else ""
    return f"{s['metric']} {s['value']:.3f}{err} ({chance}{row.get('items', '?')} items)"
