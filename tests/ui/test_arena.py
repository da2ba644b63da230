"""``kiln arena`` in a real browser: two tiny Kiln models (a GPT-2 release bundle and a llama checkpoint), the server
started by the command line on a free 127.0.0.1 port, and a scripted person voting six rounds in headless Chromium.

Run: python -m pytest tests/ui/test_arena.py -q   (needs Debian's chromium and chromium-driver)
Screenshots before and after the first vote and of the final ratings are saved in the test's temporary folder; the
final one is also copied to /tmp/arena_ratings.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import pytest
from chromium import chromium_installed, headless_chromium
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600  # importing torch, mlflow and fastapi and creating the MLflow tables: minutes on a loaded 2-core machine
WAIT_S = 60
PROMPTS = ["The cat", "A dog walks", "The old man sees", "My sister likes"]
MAX_NEW = 10
SCRIPT = ["A", "A", "tie", "A", "both_bad", "B"]  # who the person prefers, round by round
FINAL_SHOT = Path("/tmp/arena_ratings.png")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not chromium_installed(),
                       reason="Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"),
]


@pytest.fixture
def two_models(tmp_path, tiny_tokenizer):
    """{"A": release bundle folder, "B": run folder of a llama checkpoint}: different families, different weights."""
    import torch

    from kiln.model.config import ModelConfig, model_dict
    from kiln.model.families import build_model
    from kiln.release.bundle import write_release
    from kiln.train.checkpoint import save_checkpoint

    _, tok = tiny_tokenizer
    out = {}
    for name, family, seed in (("A", "gpt2", 0), ("B", "llama", 1)):
        cfg = ModelConfig(family=family, vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=32)
        torch.manual_seed(seed)
        ckpt = save_checkpoint(tmp_path / f"run_{name}" / "checkpoints", 5, {"model": build_model(cfg).state_dict()},
                               {"model": model_dict(cfg), "task": "sft"}, extra_files={"tokenizer.json": tok})
        out[name] = ckpt
    write_release(out["A"], tmp_path / "release_A", card="# A\n", extra={"name": "arena-a"})
    return {"A": tmp_path / "release_A", "B": tmp_path / "run_B"}


def expected_answers(models) -> dict[str, dict[str, str]]:
    """{prompt: {model: answer}} computed here with the same sampler and settings the server uses."""
    from kiln.arena.contestants import SamplingConfig, answer_text
    from kiln.release.bundle import load_release
    from kiln.train.checkpoint import load_for_inference

    a = load_release(models["A"])
    b = load_for_inference(models["B"])[:2]
    cfg = SamplingConfig(max_new_tokens=MAX_NEW)
    return {p: {"A": answer_text(*a, p, cfg) or "(empty answer)", "B": answer_text(*b, p, cfg) or "(empty answer)"}
            for p in PROMPTS}


@pytest.fixture
def arena_server(tmp_path, two_models):
    """(url, home, tracking uri, process): ``kiln arena A B`` in its own session, stopped by the test or at the end."""
    home, port = tmp_path / "home", free_port()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "arena.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "arena", str(two_models["A"]), str(two_models["B"]),
                                 "--home", str(home), "--port", str(port), "--prompts", str(tmp_path / "prompts.txt"),
                                 "--max-new-tokens", str(MAX_NEW), "--seed", "7", "--tracking-uri", uri],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while f"open {url}" not in log_path.read_text() or not answers(url + "ratings"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"kiln arena did not answer on {url}:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url, home, uri, proc, log_path
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the test stops it with Ctrl-C; this only catches a failure
        proc.wait(timeout=30)


def answers(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    return False


@pytest.fixture
def browser(tmp_path):
    with headless_chromium(tmp_path / "chromium-profile", WAIT_S, "1300,1100") as driver:
        yield driver


def wait_for(driver, condition, what: str, shot: Path):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.2).until(condition)
    except TimeoutException:
        driver.save_screenshot(str(shot))
        pytest.fail(f"{what} after {WAIT_S}s (screenshot {shot})")


def text_of(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').textContent")


def round_shown(driver) -> bool:
    """A round is on screen: both answers in, the vote buttons live."""
    return (driver.execute_script("return !document.getElementById('vote-left').disabled")
            and "generating" not in text_of(driver, "answer-left"))


def left_model(driver, expected) -> tuple[str, str]:
    """(prompt on screen, which model, A or B, wrote the left answer), from the answers computed beforehand."""
    prompt = text_of(driver, "prompt")
    left, right = text_of(driver, "answer-left"), text_of(driver, "answer-right")
    want = expected[prompt]
    assert {left, right} == {want["A"], want["B"]}, (prompt, left, right, want)
    return prompt, "A" if left == want["A"] else "B"


def test_a_person_votes_six_rounds_and_the_ratings_follow(arena_server, two_models, browser, tmp_path):
    from selenium.webdriver.common.by import By

    url, home, uri, proc, log_path = arena_server
    expected = expected_answers(two_models)
    assert all(e["A"] != e["B"] for e in expected.values()), expected  # the two models are told apart by their answers
    names = {"A": "arena-a", "B": "run_B"}  # the release's own name, the run folder's: no machine paths
    browser.get(url)
    wait_for(browser, round_shown, "the page showed no round", tmp_path / "arena_failed.png")
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "Model 1" in body and "Model 2" in body
    assert not any(n in body for n in (*names.values(), "release_A", "run_B")), body  # names stay hidden
    first = left_model(browser, expected)
    browser.save_screenshot(str(tmp_path / "arena_before_vote.png"))
    browser.refresh()  # a reload shows the same round (its answers come from the cache)
    wait_for(browser, round_shown, "the reloaded page showed no round", tmp_path / "arena_failed.png")
    assert left_model(browser, expected) == first
    cast = []
    for i, prefer in enumerate(SCRIPT):
        prompt, left = left_model(browser, expected)
        choice = prefer if prefer in ("tie", "both_bad") else ("left" if left == prefer else "right")
        browser.find_element(By.ID, f"vote-{choice}").click()
        wait_for(browser, lambda d: text_of(d, "name-left"), f"vote {i + 1} revealed no names", tmp_path / "arena_failed.png")
        right = "B" if left == "A" else "A"
        assert (text_of(browser, "name-left"), text_of(browser, "name-right")) == (names[left], names[right])
        cast.append((prompt, choice, names[left]))
        if i == 0:
            browser.save_screenshot(str(tmp_path / "arena_after_vote.png"))
        rows = browser.find_elements(By.CSS_SELECTOR, "#ratings tbody tr")
        assert len(rows) == 2 and f"{i + 1} vote(s)" in text_of(browser, "method")
        if i + 1 < len(SCRIPT):
            browser.find_element(By.ID, "next").click()
            wait_for(browser, lambda d: round_shown(d) and not text_of(d, "name-left"), f"no round after vote {i + 1}",
                     tmp_path / "arena_failed.png")
    table = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")]
             for tr in browser.find_elements(By.CSS_SELECTOR, "#ratings tbody tr")]
    assert [row[1] for row in table] == [names["A"], names["B"]]  # the model voted for more rates higher
    assert float(table[0][2]) > float(table[1][2]) and table[0][4:] == ["6", "3", "1", "2"]
    shot = tmp_path / "arena_ratings.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    shutil.copyfile(shot, FINAL_SHOT)

    with urllib.request.urlopen(url + "ratings", timeout=10) as r:
        ratings = json.loads(r.read())
    assert ratings["votes"] == 6 and ratings["rows"][0]["model"] == names["A"]
    assert ratings["rows"][0]["low"] <= ratings["rows"][0]["rating"] <= ratings["rows"][0]["high"]
    votes = [json.loads(line) for line in (home / "arena" / ratings["arena"] / "votes.jsonl").read_text().splitlines()]
    assert [(v["prompt"], v["vote"], v["left"]["name"]) for v in votes] == cast
    assert all(set(v) >= {"round", "time", "left", "right", "winner"} and v["left"]["weights"] for v in votes)

    proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean shutdown that closes the MLflow run
    assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    assert "kiln arena stopped: 6 votes" in log_path.read_text()
    from mlflow.tracking import MlflowClient

    from kiln.arena.tracking import metric_name

    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("arena").experiment_id],
                             f"tags.`kiln.arena_id` = '{ratings['arena']}'")[0]
    a, b = metric_name(names["A"]), metric_name(names["B"])
    assert run.info.status == "FINISHED" and run.data.params[f"model.{a}"] == names["A"]
    assert run.data.metrics["votes"] == 6 and run.data.metrics["votes.tie"] == 1 and run.data.metrics["votes.both_bad"] == 1
    assert run.data.metrics[f"rating.{a}"] > run.data.metrics[f"rating.{b}"]
    assert len(client.get_metric_history(run.info.run_id, f"rating.{a}")) == 6
