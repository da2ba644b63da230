"""The Dagster and MLflow UIs in a real browser: dagster-webserver over workspace.yaml and ``mlflow ui`` over the
session's smoke home (every asset materialized, and after it tests/test_e2e.py's reruns), driven by
headless Chromium through Selenium.

Run: python -m pytest tests/ui -q   (needs Debian's chromium and chromium-driver, which make test installs as root)
Screenshots of the asset graph, the catalog, the release's lineage and base_model's MLflow run are saved in the test's
temporary folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from chromium import chromium_installed, headless_chromium
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240  # importing the definitions (torch, mlflow, dagster) on a loaded 2-core machine
PAGE_TIMEOUT_S = 90

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not chromium_installed(),
                       reason="Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"),
]

ASSET_QUERY = """{ assetNodes { assetKey { path } dependencyKeys { path } groupName description opVersion } }"""


def graphql(url: str, query: str) -> dict:
    req = urllib.request.Request(f"{url}/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = json.loads(r.read())
    assert not body.get("errors"), body["errors"]
    return body["data"]


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session, with every child it started (they share its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # any child that ignored SIGTERM


@pytest.fixture(scope="module")
def kiln_home(smoke_run, mlflow_ui_port):
    """(home, MLflow port): the session's smoke home (tests/conftest.py smoke_run: every asset materialized on the
    Dagster instance in home/dagster, MLflow links pointing at the port the mlflow_ui fixture serves)."""
    return smoke_run[0], mlflow_ui_port


@pytest.fixture(scope="module")
def mlflow_ui(kiln_home):
    """Base URL of ``mlflow ui`` over the Kiln home's tracking database, job workers off."""
    home, port = kiln_home
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(home / "mlflow-ui.log", "wb") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "ui", "--backend-store-uri",
                                 f"sqlite:///{home / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port),
                                 "--workers", "1"], cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow ui did not answer on {url}:\n{(home / 'mlflow-ui.log').read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def webserver(kiln_home):
    """(base URL, log path) of dagster-webserver on a free 127.0.0.1 port over the Kiln home's DAGSTER_HOME.

    Started in its own session and stopped by signalling that process group, so no child outlives the test.
    """
    home = kiln_home[0] / "dagster"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = home / "webserver.log"
    env = {**os.environ, "DAGSTER_HOME": str(home), "KILN_HOME": str(kiln_home[0]), "PYTHONPATH": str(ROOT),
           "PYTHONUNBUFFERED": "1"}  # KILN_HOME as make ui sets it: the resources and launchpad of this home
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dagster_webserver", "-w", str(ROOT / "workspace.yaml"),
                                 "-h", "127.0.0.1", "-p", str(port)], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"dagster-webserver exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if graphql(url, ASSET_QUERY)["assetNodes"]:  # answers, and the code location has loaded
                    break
            except (urllib.error.URLError, ConnectionError, OSError, AssertionError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"dagster-webserver did not answer on {url} within {START_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        graphql(url, "mutation { setNuxSeen }")  # no first-visit 'Join the community' dialog over the pages
        yield url, log_path
    finally:  # the server and its code-location subprocess share the group whose id is the server's pid
        stop_group(proc)


@pytest.fixture(scope="module")
def expected():
    """{asset name: (parent names, group, description, code version)} from the Definitions the server loads."""
    from jobs.definitions import defs

    graph = defs.resolve_asset_graph()
    out = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        out[key.to_user_string()] = ({p.to_user_string() for p in node.parent_keys}, node.group_name, node.description,
                                     node.code_version)
    return out


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    # tall: the asset graph draws only the nodes on screen
    with headless_chromium(tmp_path_factory.mktemp("chromium-profile"), PAGE_TIMEOUT_S, "1600,1800") as driver:
        yield driver


def node_labels(driver) -> list[str]:
    """The names written on the asset nodes of the graph on screen (long ones are cut in the middle with '…')."""
    return driver.execute_script("return Array.from(document.querySelectorAll('[class*=assetName]')).map(e => e.textContent)")


def shows(label: str, name: str) -> bool:
    if "…" not in label:
        return label == name
    head, tail = label.split("…", 1)
    return len(head) >= 3 and name.startswith(head) and name.endswith(tail)


def missing_from_graph(driver, names) -> list[str]:
    labels = node_labels(driver)
    return [n for n in names if not any(shows(label, n) for label in labels)]


def wait_for(driver, condition, what, shot: Path):
    """Wait until ``condition(driver)``; else save ``shot`` and fail with ``what()`` (which describes the page then)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, PAGE_TIMEOUT_S, poll_frequency=0.5).until(condition)
    except TimeoutException:
        driver.save_screenshot(str(shot))
        pytest.fail(f"{what()} after {PAGE_TIMEOUT_S}s (screenshot {shot})")


def test_graphql_lists_every_asset_with_its_lineage(webserver, expected) -> None:
    url, _ = webserver
    nodes = {"/".join(n["assetKey"]["path"]): n for n in graphql(url, ASSET_QUERY)["assetNodes"]}
    assert set(nodes) == set(expected)
    for name, (parents, group, description, code_version) in expected.items():
        n = nodes[name]
        assert {"/".join(d["path"]) for d in n["dependencyKeys"]} == parents, name
        assert (n["groupName"], n["description"], n["opVersion"]) == (group, description, code_version), name
    assert "sft_model" in {"/".join(d["path"]) for d in nodes["release_bundle"]["dependencyKeys"]}
    assert nodes["raw_documents"]["dependencyKeys"] == []


def test_asset_graph_renders_every_asset(webserver, expected, browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    url, _ = webserver
    groups = sorted({g for _, g, _, _ in expected.values()})
    # the global graph starts with groups collapsed; the URL's "expanded" list opens them all
    browser.get(f"{url}/asset-groups?expanded=" + ",".join(f"global@global:{g}" for g in groups))
    zoom_out = "//button[.//*[@aria-label='zoom_out']]"
    wait_for(browser, lambda d: d.find_elements(By.XPATH, zoom_out) and node_labels(d),
             lambda: "the asset graph drew no node", tmp_path / "asset_graph_failed.png")
    time.sleep(2)  # let the layout settle
    for _ in range(3):  # nodes off screen are not drawn: zoom out a step while some are missing and names still show
        if not missing_from_graph(browser, expected):
            break
        browser.find_element(By.XPATH, zoom_out).click()
        time.sleep(1)
    missing = missing_from_graph(browser, expected)
    if missing:
        browser.save_screenshot(str(tmp_path / "asset_graph_failed.png"))
        pytest.fail(f"asset graph does not show {missing}; it shows {node_labels(browser)} (screenshot in {tmp_path})")
    shot = tmp_path / "asset_graph.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "Global asset lineage" in body and all(g in body for g in groups)


def test_catalog_lists_every_asset(webserver, expected, browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    url, _ = webserver
    browser.get(f"{url}/assets")
    text = lambda d: d.find_element(By.TAG_NAME, "body").text  # noqa: E731
    wait_for(browser, lambda d: all(n in text(d) for n in expected),
             lambda: f"catalog lacks {[n for n in expected if n not in text(browser)]}", tmp_path / "catalog_failed.png")
    assert browser.save_screenshot(str(tmp_path / "catalog.png"))


def test_release_lineage_page_shows_its_upstream_assets(webserver, expected, browser, tmp_path) -> None:
    url, _ = webserver
    parents = expected["release_bundle"][0]
    browser.get(f"{url}/assets/release_bundle?view=lineage&lineageScope=upstream&lineageDepth=1")
    want = {"release_bundle", *parents}
    wait_for(browser, lambda d: not missing_from_graph(d, want),
             lambda: f"release lineage lacks {missing_from_graph(browser, want)}", tmp_path / "release_lineage_failed.png")
    time.sleep(2)  # let the edges draw before the picture
    assert browser.save_screenshot(str(tmp_path / "release_lineage.png"))
    drawn = {n for n in expected if any(shows(label, n) for label in node_labels(browser))}
    assert drawn == want  # depth 1: exactly the release and the assets it reads


def test_launchpad_shows_training_plan_config_as_typed_fields(webserver, browser, tmp_path) -> None:
    """The launchpad validates training_plan's nested blocks field by field: a misspelt model key is flagged by
    name, and the type panel lists the model's fields with their types and descriptions."""
    import urllib.parse

    from selenium.webdriver.common.by import By

    url, _ = webserver
    config = "ops:\n  training_plan:\n    config:\n      model_preset: tiny\n      model:\n        n_layer: 2\n        n_layr: 3\n"
    browser.get(f"{url}/locations/__repository__@kiln/jobs/kiln_pipeline_job/playground/setup?"
                + urllib.parse.urlencode({"config": config}))
    text = lambda d: d.find_element(By.TAG_NAME, "body").text  # noqa: E731
    wait_for(browser, lambda d: "n_layr" in text(d), lambda: f"the launchpad does not show the config: {text(browser)[:500]}",
             tmp_path / "launchpad_failed.png")
    lines = browser.find_elements(By.XPATH, "//*[contains(@class, 'CodeMirror-line')][contains(., 'n_layer')]")
    assert lines, "no editor line holds n_layer"
    lines[0].click()  # the type panel follows the cursor: ModelConfig's fields
    wait_for(browser, lambda d: "n_embd" in text(d) and "n_head" in text(d),
             lambda: f"the type panel does not list the model fields: {text(browser)[-800:]}", tmp_path / "launchpad_failed.png")
    time.sleep(1)
    shot = tmp_path / "launchpad_training_plan.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
    body = text(browser)
    assert "n_layr" in body and ("unexpected" in body.lower() or "not defined" in body.lower() or "error" in body.lower())


def test_the_launchpad_opens_with_the_preset_the_home_was_built_with(webserver, browser, tmp_path) -> None:
    """The home was made by the smoke preset (recorded in HOME/preset.json as kiln run records it): the job's
    launchpad opens with its settings, not the class defaults (a 8192-token tokenizer, a 12-layer GPT-2)."""
    import yaml
    from selenium.webdriver.common.by import By

    from jobs.presets import load_preset

    url, _ = webserver
    data = graphql(url, """{ runConfigSchemaOrError(selector: {repositoryLocationName: "kiln", repositoryName:
        "__repository__", pipelineName: "kiln_pipeline_job"}) { ... on RunConfigSchema { rootDefaultYaml } } }""")
    ops = yaml.safe_load(data["runConfigSchemaOrError"]["rootDefaultYaml"])["ops"]
    smoke = load_preset("smoke")["ops"]
    assert ops["tokenizer"]["config"]["vocab_size"] == smoke["tokenizer"]["config"]["vocab_size"] == 512
    assert {k: ops["training_plan"]["config"]["model"][k] for k in smoke["training_plan"]["config"]["model"]} \
        == smoke["training_plan"]["config"]["model"]
    assert ops["base_model"]["config"]["eval_interval"] == smoke["base_model"]["config"]["eval_interval"]
    browser.get(f"{url}/locations/__repository__@kiln/jobs/kiln_pipeline_job/playground")
    browser.execute_script("window.localStorage.clear()")  # the launchpad keeps an earlier test's tab: a new user's
    browser.get(f"{url}/locations/__repository__@kiln/jobs/kiln_pipeline_job/playground")
    text = lambda d: d.find_element(By.TAG_NAME, "body").text  # noqa: E731
    wait_for(browser, lambda d: "ckpt_interval: 20" in text(d) and "eval_batches: 4" in text(d),  # base_model's, on top
             lambda: f"the launchpad does not open with the smoke preset: {text(browser)[:800]}",
             tmp_path / "launchpad_preset_failed.png")


def test_base_model_links_to_its_mlflow_run_which_shows_the_training_metrics(webserver, mlflow_ui, kiln_home, browser,
                                                                          tmp_path) -> None:
    """The asset page of base_model links to its MLflow run; that page lists the metrics training logged."""
    from selenium.webdriver.common.by import By

    url, _ = webserver
    browser.get(f"{url}/assets/base_model")
    link = "//a[contains(@href, '#/experiments/') and contains(@href, '/runs/')]"
    wait_for(browser, lambda d: d.find_elements(By.XPATH, link), lambda: "base_model's page shows no MLflow run link",
             tmp_path / "base_model_failed.png")
    href = browser.find_element(By.XPATH, link).get_attribute("href")
    assert href.startswith(f"{mlflow_ui}/#/experiments/"), href
    browser.get(href)
    text = lambda d: d.find_element(By.TAG_NAME, "body").text  # noqa: E731
    wait_for(browser, lambda d: all(m in text(d) for m in ("train_loss", "val_loss")),
             lambda: f"the MLflow run page lacks the training metrics: {text(browser)[:800]}", tmp_path / "mlflow_run_failed.png")
    assert "base_model" in text(browser)
    time.sleep(1)
    shot = tmp_path / "mlflow_run.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
