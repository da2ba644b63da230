"""``kiln run``'s console (jobs.console): asset start and end lines with headline figures, progress lines from the
workers' step messages, failures, warnings filtered, and every record in the run's log file."""

import io
import logging
import warnings
from types import SimpleNamespace

from jobs.console import RunConsole, asset_of, headline, quiet_dependency_warnings, score_line


def record(message: str = "", step: str | None = None, event=None, level: int = logging.INFO) -> logging.LogRecord:
    rec = logging.LogRecord("kiln.run", level, __file__, 1, message, (), None)
    rec.dagster_meta = {"step_key": step, "dagster_event": event, "orig_message": message}
    return rec


def event(kind: str, **data):
    return SimpleNamespace(event_type_value=kind, event_specific_data=SimpleNamespace(**data))


def materialized(asset: str, **metadata):
    key = SimpleNamespace(to_user_string=lambda: asset)
    return event("ASSET_MATERIALIZATION", materialization=SimpleNamespace(asset_key=key, metadata=metadata))


def test_asset_of_a_step_and_headline_figures():
    assert asset_of("clean_corpus.clean_shard[s00001_owt]") == "clean_corpus" and asset_of("base_model") == "base_model"
    assert headline("clean_corpus", {"kept_documents": 677, "dropped_documents": 773}) == "kept 677 documents, dropped 773"
    assert headline("base_model", {"final_val_loss": 5.40205, "tokens_per_s": 8461.9}) == "validation loss 5.402, 8,462 tokens/s"
    # every post-training stage ends on the figure it moves, not on its step count alone
    assert headline("dpo_model", {"held_out_reward_accuracy": 0.8114, "steps": 40}) == "held-out reward accuracy 0.81, 40 steps"
    assert headline("rl_model", {"final_held_out_reward": 0.07, "steps": 60}) == "held-out reward 0.070, 60 steps"
    assert headline("reward_model", {"held_out_accuracy": 0.6, "steps": 30}) == "held-out pair accuracy 0.60, 30 steps"
    assert headline("ppo_model", {"final_held_out_reward": -0.25, "steps": 20}) == "held-out reward -0.250, 20 steps"
    assert headline("tokenizer", {}) == "" and headline("unknown_asset", {"x": 1}) == ""


def test_a_run_shows_starts_ends_progress_and_failures_and_logs_everything(tmp_path):
    out = io.StringIO()
    console = RunConsole(tmp_path / "run-events.log", ["clean_corpus", "base_model"], stream=out, plain=True)
    log = console._logger()
    with console:
        log.handle(record(step="clean_corpus.plan_clean_shards", event=event("STEP_START")))
        log.handle(record(step="clean_corpus.clean_shard[s0]", event=event("STEP_START")))  # the same asset
        log.handle(record("clean shard 0 (owt): 300 of 300 docs", step="clean_corpus.clean_shard[s0]"))
        log.handle(record(step="clean_corpus.merge_clean_shards",
                          event=materialized("clean_corpus", kept_documents=677, dropped_documents=773)))
        log.handle(record(step="contamination_report_contamination_below_threshold", event=event("STEP_START")))
        log.handle(record(step="base_model", event=event("STEP_START")))
        for step in (10, 20, 60):
            log.handle(record(f"step {step}/60: loss 5.8738 | val 6.2496 | lr 1.00e-03 | grad_norm 0.91 | "
                              f"23,385 tok/s | 0.29 GiB | 5s left", step="base_model"))
        log.handle(record("loss spike at step 30: rolled back", step="base_model", level=logging.WARNING))
        log.handle(record(step="base_model", event=event("STEP_FAILURE")))
    lines = out.getvalue().splitlines()
    assert lines[0] == "▶ clean_corpus"
    assert lines[1].startswith("✓ clean_corpus") and lines[1].endswith("kept 677 documents, dropped 773")
    assert lines[2] == "▶ base_model"  # an asset check's step is no asset
    assert lines[3] == "  base_model step 10/60  loss 5.8738  val 6.2496  23,385 tok/s  5s left"
    assert lines[4].startswith("  base_model step 60/60")  # 20/60 came within 30 s of 10/60: not shown
    assert lines[5] == "  ! base_model: loss spike at step 30: rolled back"
    assert lines[6].startswith("✗ base_model failed after ")
    assert len(lines) == 7
    written = (tmp_path / "run-events.log").read_text()
    assert "clean shard 0 (owt): 300 of 300 docs" in written and "step 20/60" in written  # the file has everything


def test_dependency_warnings_go_to_the_log_only(tmp_path):
    from dagster import BetaWarning

    seen: list[str] = []
    with warnings.catch_warnings(record=False):
        shown = io.StringIO()
        warnings.showwarning = lambda m, c, f, n, file=None, line=None: shown.write(f"{c.__name__}: {m}\n")
        quiet_dependency_warnings(seen.append)
        warnings.warn("Parameter data_version is in beta", BetaWarning)
        warnings.warn_explicit("old API", DeprecationWarning, "/venv/lib/python3.11/site-packages/lib/x.py", 3)
        warnings.warn_explicit("check this", UserWarning, "/venv/lib/python3.11/site-packages/lib/x.py", 4)
    assert len(seen) == 3 and seen[0].startswith("BetaWarning: Parameter data_version is in beta")
    assert shown.getvalue() == "UserWarning: check this\n"


def test_score_line_gives_the_primary_metric_beside_chance():
    row = {"acc": 0.15, "acc_norm": 0.15, "acc_norm_stderr": 0.0819, "chance": 0.25, "items": 20}
    assert score_line("kiln_continuation", row) == "acc_norm 0.150 ± 0.082 (chance 0.25, 20 items)"
    assert score_line("kiln_heldout_ppl", {"bits_per_byte": 3.9188, "chance": None, "items": 20}) == "bits_per_byte 3.919 (20 items)"


def dpo_and_rl_lines() -> list[str]:
    """Progress lines exactly as the DPO and RL stages write them (kiln.posttrain.dpo / rl .progress)."""
    from kiln.posttrain.dpo import DpoStage
    from kiln.posttrain.rl import RlStage
    from kiln.train.trainer import StepReport

    dpo = StepReport(3, 6, {"loss": 0.6931, "reward_accuracy": 0.5625, "reward_margin": 0.0123, "chosen_logp": -45.2311,
                            "rejected_logp": -47.8802}, None, {"grad_norm": 1.234}, None, 75.0)
    rl = StepReport(2, 4, {"reward_mean": 0.25, "exact_answer": 0.125, "kl": 0.0012, "groups_with_signal": 0.5,
                           "answer_tokens": 3.25, "rollout_s": 0.25, "rollout_tokens_per_s": 2589.3},
                    {"val_reward": 0.3}, {"grad_norm": 0.5, "step_time_s": 0.83}, None, 3725.0)
    return [DpoStage.progress(None, dpo), RlStage.progress(None, rl)]


def test_dpo_and_rl_progress_lines_keep_within_80_columns_and_the_log_keeps_all(tmp_path):
    dpo, rl = dpo_and_rl_lines()
    assert len(dpo) > 80 and len(rl) > 80  # the whole text is wider than a terminal
    out = io.StringIO()
    console = RunConsole(tmp_path / "run-events.log", ["dpo_model", "rl_model", "eval_scores"], stream=out, plain=True)
    log = console._logger()
    with console:
        log.handle(record(dpo, step="dpo_model"))
        log.handle(record(rl, step="rl_model"))
    lines = out.getvalue().splitlines()
    assert lines == ["  dpo_model step 3/6  loss 0.6931  reward acc 0.56  margin 0.012  1m15s left",
                     "  rl_model step 2/4  reward 0.250  held-out reward 0.300  1h02m left"]
    assert all(len(ln) <= 80 for ln in lines)
    written = (tmp_path / "run-events.log").read_text()
    assert dpo in written and rl in written and "rejected -47.88 | grad_norm 1.23" in written
    assert "| rollout 0.25 s, 2,589 tok/s of 0.83 s |" in written


def test_bars_on_an_80_column_terminal_fit_their_figures(tmp_path, monkeypatch):
    from rich.console import Console

    monkeypatch.setenv("COLUMNS", "80")
    dpo, rl = dpo_and_rl_lines()
    console = RunConsole(tmp_path / "run-events.log", ["dpo_model", "rl_model"], stream=io.StringIO(), plain=False)
    log = console._logger()
    with console:
        log.handle(record(dpo, step="dpo_model"))
        log.handle(record(rl, step="rl_model"))
        fields = [t.fields for t in console._progress.tasks]
        screen = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
        with screen.capture() as shot:
            screen.print(console._progress.get_renderable())
    assert fields == [{"status": "loss 0.6931  reward acc 0.56", "left": "1m15s left"},
                      {"status": "reward 0.250", "left": "1h02m left"}]
    rows = shot.get().splitlines()
    assert len(rows) == 2 and all(len(r) <= 80 for r in rows)
    assert "loss 0.6931  reward acc 0.56" in rows[0] and rows[0].rstrip().endswith("1m15s left")  # nothing cut


def test_eval_progress_shows_requests_done_of_total_with_rate_and_time_left(tmp_path):
    from kiln.evaluation.adapter import RequestProgress

    now = [0.0]
    said: list[str] = []
    tell = RequestProgress(said.append, "loglikelihood", 400, clock=lambda: now[0])
    for done, t in ((40, 2.0), (400, 9.0)):
        now[0] = t
        tell.reached(done)
    out = io.StringIO()
    console = RunConsole(tmp_path / "run-events.log", ["eval_scores"], stream=out, plain=True)
    log = console._logger()
    with console:
        log.handle(record(step="eval_scores", event=event("STEP_START")))
        for line in said:
            log.handle(record(line, step="eval_scores"))
    assert out.getvalue().splitlines() == ["▶ eval_scores",
                                           "  eval_scores eval 40/400  loglikelihood  20.0 requests/s  18s left",
                                           "  eval_scores eval 400/400  loglikelihood  44.4 requests/s  0s left"]


def test_a_failed_check_says_why_one_reason_a_line(tmp_path):
    out = io.StringIO()
    console = RunConsole(tmp_path / "run-events.log", ["release_bundle"], stream=out, plain=True)
    key = SimpleNamespace(to_user_string=lambda: "release_bundle")
    with console:
        console._logger().handle(record(step="release_bundle_release_no_regression", event=event(
            "ASSET_CHECK_EVALUATION", passed=False, check_name="release_no_regression", asset_key=key,
            description="ppo_model made response_loss worse than sft_model; released.response_loss: 2.5 -> 2.7")))
        console._logger().handle(record(step="release_bundle_release_no_regression", event=event(
            "ASSET_CHECK_EVALUATION", passed=False, check_name="other", asset_key=key, description=None)))
    assert out.getvalue().splitlines() == [
        "  ! check release_no_regression on release_bundle failed:",
        "      ppo_model made response_loss worse than sft_model",
        "      released.response_loss: 2.5 -> 2.7",
        "  ! check other on release_bundle failed"]
