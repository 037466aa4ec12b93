"""The web dashboard in a real browser: Debian's headless Chromium, driven by Selenium,
against a stack of real processes with API keys on. Screenshots go to test-artifacts/."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import pytest
import redis
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from app.store.keys import job_key
from mpjobs.cli.words import fp8_summary_words, precision_speed_words, speed_cell
from mpjobs.contract.formats import number, percent, rate
from mpjobs.contract.fp8 import Fp8Tensor
from scripts.stack import ROOT, Stack, private_stack, stopped, wait_until
from tests.browser import headless_chromium

KEY = "dashboard-key"
STATIC = ROOT / "app" / "static"
ARTIFACTS = ROOT / "test-artifacts"
URL = re.compile(r"https?://", re.IGNORECASE)
T = TypeVar("T")


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with private_stack(tmp_path_factory.mktemp("dashboard"), API_KEYS=f"{KEY}:tenant-d") as stack:
        yield stack


@pytest.fixture(scope="module")
def api(keyed_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed_stack.base_url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    with headless_chromium("--window-size=1400,1000", browser_logs=True) as driver:
        yield driver


def wait_for(driver: WebDriver, check: Callable[[WebDriver], T | None | Literal[False]], timeout: float,
             what: str) -> T:
    waiter = WebDriverWait(driver, timeout, poll_frequency=0.05, ignored_exceptions=[StaleElementReferenceException])
    result = waiter.until(check, f"timed out after {timeout}s waiting for {what}")
    assert result is not None  # until() returns only truthy results
    return result


def by_testid(driver: WebDriver, name: str) -> WebElement:
    return driver.find_element(By.CSS_SELECTOR, f'[data-testid="{name}"]')


def shown(name: str) -> Callable[[WebDriver], WebElement | None]:
    def check(driver: WebDriver) -> WebElement | None:
        element = by_testid(driver, name)
        return element if element.is_displayed() else None

    return check


def attr(driver: WebDriver, name: str, attribute: str) -> str | None:
    return by_testid(driver, name).get_attribute(attribute)


def text_of(driver: WebDriver, name: str) -> str:
    """An element's text read in one script call: a panel re-rendered by polling cannot go stale mid-read."""
    text = driver.execute_script(f"return document.querySelector('[data-testid=\"{name}\"]')?.innerText ?? ''")
    return str(text)


def dialog_open(driver: WebDriver) -> bool:
    return bool(driver.execute_script("return document.getElementById('key-dialog').open"))


def open_dashboard(driver: WebDriver, stack: Stack, route: str) -> None:
    """Loads a view in a fresh page; enters the API key when the page asks for it."""
    driver.get("about:blank")  # a new document even when only the hash would change
    driver.get(f"{stack.base_url}/{route}")
    if wait_for(driver, lambda d: "key" if dialog_open(d) else d.find_elements(By.CSS_SELECTOR, "main > *"),
                10, "the view or the key dialog") == "key":
        enter_key(driver, KEY)


def enter_key(driver: WebDriver, key: str) -> None:
    field = by_testid(driver, "key-input")
    field.clear()
    field.send_keys(key)
    by_testid(driver, "key-submit").click()


def set_value(driver: WebDriver, field: str, value: object) -> None:
    element = driver.find_element(By.CSS_SELECTOR, f'[data-field="{field}"]')
    if element.tag_name == "select":
        Select(element).select_by_value(str(value))
    else:
        element.clear()
        element.send_keys(str(value))


def fill_form(driver: WebDriver, values: dict[str, object]) -> None:
    for field, value in values.items():
        set_value(driver, field, value)


def submit_job(driver: WebDriver, values: dict[str, object]) -> str:
    """Fills and submits the form; returns the new job's id from the confirmation link."""
    fill_form(driver, values)
    before = by_testid(driver, "submit-status").text
    by_testid(driver, "submit-job").click()
    link = wait_for(driver, lambda d: by_testid(d, "submit-status").text != before
                    and by_testid(d, "submit-status").find_element(By.TAG_NAME, "a"), 10, "the job to be queued")
    href = link.get_attribute("href") or ""
    return href.rsplit("/", 1)[-1]


def chart(driver: WebDriver, key: str) -> dict[str, int]:
    element = by_testid(driver, f"chart-{key}")
    return {name: int(element.get_attribute(f"data-{name}") or 0) for name in ("points", "skipped")}


def or_dash(value: Any, show: Callable[[Any], str]) -> str:
    """A value as the dashboard shows it: "–" when the API has none."""
    return "–" if value is None else show(value)


def page_errors(driver: WebDriver) -> list[str]:
    """Uncaught script errors and Content-Security-Policy refusals logged since the last call.
    (Failed fetches are not counted: one test kills the API on purpose.)"""
    messages = [entry["message"] for entry in driver.get_log("browser")]
    return [m for m in messages if "Uncaught" in m or "Content Security Policy" in m]


def screenshot(driver: WebDriver, name: str) -> Path:
    """The whole page, not just the window."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    size = driver.get_window_size()
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(size["width"], max(size["height"], int(height) + 120))
    try:
        assert driver.save_screenshot(str(path)), path
    finally:
        driver.set_window_size(size["width"], size["height"])
    return path


def test_dashboard_and_vendored_uplot_are_served_without_a_key_or_a_cdn(keyed_stack: Stack) -> None:
    page = httpx.get(f"{keyed_stack.base_url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    referenced = [ref for ref in re.findall(r'(?:src|href)="([^"#]+)"', page.text) if ref != "data:,"]
    assert {"/static/vendor/uPlot.iife.min.js", "/static/vendor/uPlot.min.css", "/static/style.css",
            "/static/js/app.js"} <= set(referenced)
    for path in referenced:
        assert path.startswith("/static/"), path
        assert httpx.get(keyed_stack.base_url + path).status_code == 200, path

    license_text = httpx.get(f"{keyed_stack.base_url}/static/vendor/uPlot.LICENSE")
    assert license_text.status_code == 200 and "MIT License" in license_text.text
    assert license_text.headers["content-type"].startswith("text/plain")
    assert "Leon Sorokin" in license_text.text
    bundle = (STATIC / "vendor" / "uPlot.iife.min.js").read_text()
    assert bundle.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
    # The vendored files are the ones vendor/README.md says were taken from the npm tarball.
    recorded = dict(re.findall(r"^([0-9a-f]{64})  (\S+)$", (STATIC / "vendor" / "README.md").read_text(), re.M))
    assert sorted(recorded.values()) == ["uPlot.LICENSE", "uPlot.iife.min.js", "uPlot.min.css"]
    for digest, name in recorded.items():
        assert hashlib.sha256((STATIC / "vendor" / name).read_bytes()).hexdigest() == digest, name

    # No URL outside the origin anywhere the browser loads: our files have none at all, and the
    # vendored bundle's only one is in its banner comment.
    ours = [p for p in STATIC.rglob("*") if p.suffix in {".html", ".js", ".css"} and p.parent.name != "vendor"]
    assert ours and all(not URL.search(p.read_text()) for p in ours), [p for p in ours if URL.search(p.read_text())]
    assert not URL.search(bundle.split("*/", 1)[1])
    assert not URL.search((STATIC / "vendor" / "uPlot.min.css").read_text())


def run_past(r: redis.Redis, job_id: str, pid: int, step: int, steps: int) -> int | None:
    """Lets the worker `pid` (its own process group) run until the job has stored a step past `step`,
    polling Redis every millisecond, then SIGSTOPs it. Returns the stored step if, with the worker
    stopped, the job is still mid-run (running, fewer than `steps` steps); None if it got to its end."""
    def moved() -> bool:
        state, done = r.hmget(job_key(job_id), "state", "step")
        return state != "running" or int(done or 0) > step

    os.killpg(pid, signal.SIGCONT)
    wait_until(moved, 120, f"job {job_id} past step {step}", interval=0.001)
    os.killpg(pid, signal.SIGSTOP)
    wait_until(lambda: stopped(pid), 10, f"worker {pid} to stop", interval=0.001)
    state, done = r.hmget(job_key(job_id), "state", "step")
    return int(done) if state == "running" and int(done or 0) < steps else None


def plotted(driver: WebDriver) -> int:
    """Steps on the page's loss-scale chart: one point per step, never a gap."""
    return chart(driver, "loss-scale")["points"]


def job_worker(api: httpx.Client, job_id: str) -> int:
    """The pid of the worker that took the job, once it runs; that worker leads its own process group."""
    worker = wait_until(lambda: api.get(f"/jobs/{job_id}").json()["worker"], 120, f"job {job_id} to start")
    pid = int(worker["pid"])
    assert os.getpgid(pid) == pid  # SIGSTOP to the group reaches that worker and nothing else
    return pid


def charts_fill_mid_run(browser: WebDriver, api: httpx.Client, r: redis.Redis, job_id: str, pid: int,
                        steps: int) -> int | None:
    """Stops the job's worker past step 2, opens the job's page from the list and reads its charts;
    lets a burst of steps run, stops the worker again and reads the charts again, now grown from the
    live stream. Both reads inside the running state. Returns the last step drawn, the worker left
    stopped; None if the job reached its end first (a fast machine)."""
    held = run_past(r, job_id, pid, 2, steps)
    if held is None:
        return None
    row = f'[data-testid="job-row"][data-job-id="{job_id}"]'
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row), 10, "the job in the list")
    page = f'[data-testid="job-page"][data-job-id="{job_id}"]'

    def opened(driver: WebDriver) -> bool:
        # The live list redraws its rows: a link found before a redraw is stale, so find it and click again.
        if not driver.find_elements(By.CSS_SELECTOR, page):
            driver.find_element(By.CSS_SELECTOR, f'{row} [data-testid="job-link"]').click()
        return bool(driver.find_elements(By.CSS_SELECTOR, page))

    wait_for(browser, opened, 10, "the job page")
    wait_for(browser, lambda d: plotted(d) == held and attr(d, "job-page", "data-state") == "running",
             60, f"the {held} steps done to be plotted")
    job = api.get(f"/jobs/{job_id}").json()
    assert job["state"] == "running" and job["progress"]["step"] == held, job["progress"]
    first = {key: chart(browser, key)["points"] for key in ("loss", "loss-scale")}
    assert first["loss-scale"] == held > 0
    wait_for(browser, lambda d: text_of(d, "stream-status") == "Live.", 10, "the live stream")

    held = run_past(r, job_id, pid, held, steps)
    if held is None:
        return None
    wait_for(browser, lambda d: plotted(d) == held, 20, f"the burst's steps, to step {held}, to be plotted")
    assert all(chart(browser, key)["points"] > first[key] for key in first)
    job = api.get(f"/jobs/{job_id}").json()
    assert job["state"] == "running" and job["progress"]["step"] == held < steps, job["progress"]
    return held


def test_a_job_from_the_form_charts_live_and_its_stream_survives_an_api_restart(
    keyed_stack: Stack, api: httpx.Client, browser: WebDriver,
) -> None:
    # A fresh tab session: the list meets a 401 and asks for the key; a wrong one is refused.
    browser.get(f"{keyed_stack.base_url}/#/jobs")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    wait_for(browser, dialog_open, 10, "the key dialog")
    enter_key(browser, "not-the-key")
    wait_for(browser, lambda d: dialog_open(d) and by_testid(d, "key-error").is_displayed(), 10, "the key refusal")
    enter_key(browser, KEY)
    wait_for(browser, lambda d: attr(d, "job-list", "data-count") is not None, 10, "the job list")
    assert not dialog_open(browser)
    assert browser.execute_script("return sessionStorage.getItem('mpjobs.apiKey')") == KEY

    # The job's worker is stopped (SIGSTOP) wherever the test must find the job mid-run, and let go
    # in bursts, so every check holds on a machine of any speed. A job that reached its end all the
    # same (a fast machine) is submitted again, from the form, with four times the steps.
    r, steps, pid = keyed_stack.redis.client(), 60, None
    try:
        for _ in range(3):
            job_id = submit_job(browser, {
                "name": "dashboard live", "model.name": "mlp", "precision_policy": "mixed_float16",
                "loss_scale.mode": "dynamic", "loss_scale.initial_scale": 32768, "loss_scale.growth_steps": 10,
                "training.steps": steps, "training.batch_size": 32, "training.learning_rate": 0.001,
            })
            spec = api.get(f"/jobs/{job_id}").json()["spec"]
            assert spec["precision_policy"] == "mixed_float16"
            assert spec["loss_scale"] == {"mode": "dynamic", "initial_scale": 32768.0, "growth_steps": 10}
            assert spec["training"]["steps"] == steps and spec["training"]["batch_size"] == 32
            pid = job_worker(api, job_id)
            held = charts_fill_mid_run(browser, api, r, job_id, pid, steps)
            if held is not None:
                break
            os.killpg(pid, signal.SIGCONT)
            open_dashboard(browser, keyed_stack, "#/jobs")  # a fresh form
            steps *= 4
        else:
            raise AssertionError(f"no job of up to {steps // 4} steps was still mid-run after a burst")

        # The API dies mid-run (its worker stopped, every stored step drawn); the page sees the break,
        # reconnects to the new API with ?after=<the last step drawn>, and misses nothing.
        assert keyed_stack.api is not None
        keyed_stack.api.kill()
        keyed_stack.api.wait(10)
        wait_for(browser, lambda d: text_of(d, "stream-status") == "Reconnecting…", 20, "the page to see the break")
        api_log = keyed_stack.logs / "api.log"
        restarted_at = api_log.stat().st_size
        keyed_stack.start_api()
        wait_for(browser, lambda d: text_of(d, "stream-status") == "Live.", 30, "the page to reconnect")
        assert r.hget(job_key(job_id), "state") == "running" and plotted(browser) == held
        with api_log.open("rb") as log:
            log.seek(restarted_at)
            afters = re.findall(rf"GET /jobs/{job_id}/metrics/stream\?after=(\d+)", log.read().decode())
        assert afters and set(afters) == {str(held)}, afters
    finally:  # never leave a stopped worker, or no API, to the module's other tests
        if pid is not None:
            os.killpg(pid, signal.SIGCONT)
        if keyed_stack.api is not None and keyed_stack.api.poll() is not None:
            keyed_stack.start_api()

    done = keyed_stack.wait_for_state(api, job_id, {"succeeded", "failed", "canceled"}, timeout=120)
    assert done["state"] == "succeeded", done["error"]
    wait_for(browser, lambda d: attr(d, "stream-status", "textContent") == "Run ended."
             and attr(d, "job-page", "data-state") == "succeeded", 30, "the page to see the end")
    skipped = done["summary"]["skipped_steps"]
    assert skipped > 0, "growth_steps=10 must reach an overflowing scale"
    # Every step drawn once, though the stream broke mid-run; a red line per skipped step. A chart
    # counts the values it plots, so a non-finite value (null: a gap) is not counted.
    points = api.get(f"/jobs/{job_id}/metrics", params={"limit": steps}).json()["points"]
    assert [p["step"] for p in points] == list(range(1, steps + 1))
    for key, field in (("loss", "loss"), ("loss-scale", "loss_scale"), ("grad-norm", "grad_norm"),
                       ("zero-grad", "zero_grad_fraction")):
        drawn = sum(p[field] is not None for p in points)
        assert chart(browser, key) == {"points": drawn, "skipped": skipped}, key
    assert chart(browser, "loss-scale")["points"] == steps

    # mixed_float16 on a CPU: the summary ends with the run's speed check against float32 (a GPU
    # worker runs none).
    ps = done["summary"]["precision_speed"]
    if done["worker"]["device"]["kind"] == "cpu":
        assert ps is not None
        wait_for(browser, lambda d: "Step time against float32 (this CPU)" in text_of(d, "summary"), 10,
                 "the speed check in the summary")
        assert precision_speed_words(ps) in text_of(browser, "summary")
    else:
        assert ps is None and "Step time against float32" not in text_of(browser, "summary")
    diagnoses = by_testid(browser, "diagnoses").text
    for diagnosis in done["summary"]["diagnoses"]:
        assert diagnosis["message"] in diagnoses
    transitions = by_testid(browser, "transitions").find_elements(By.CSS_SELECTOR, "tbody tr")
    assert [t.find_element(By.CSS_SELECTOR, "td").text for t in transitions] == ["queued", "running", "succeeded"]
    assert by_testid(browser, "cancel-job").get_attribute("disabled") is not None
    assert screenshot(browser, "dashboard-job.png").stat().st_size > 10_000

    # Everything the browser loaded came from this origin.
    loaded: list[str] = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(keyed_stack.base_url) for url in loaded), loaded
    assert page_errors(browser) == []


def test_cancel_button_cancels_a_running_job(keyed_stack: Stack, api: httpx.Client, browser: WebDriver) -> None:
    open_dashboard(browser, keyed_stack, "#/jobs")
    job_id = submit_job(browser, {"name": "dashboard cancel", "precision_policy": "float32",
                                  "loss_scale.mode": "none", "training.steps": 100_000})
    browser.get(f"{keyed_stack.base_url}/#/jobs/{job_id}")
    wait_for(browser, lambda d: chart(d, "loss")["points"] > 0, 60, "the job to run")
    by_testid(browser, "cancel-job").click()

    done = keyed_stack.wait_for_state(api, job_id, {"succeeded", "failed", "canceled"}, timeout=30)
    assert done["state"] == "canceled" and done["progress"]["step"] < 100_000
    wait_for(browser, lambda d: attr(d, "job-page", "data-state") == "canceled"
             and attr(d, "stream-status", "textContent") == "Run ended.", 20, "the page to show canceled")
    assert by_testid(browser, "cancel-job").get_attribute("disabled") is not None
    assert page_errors(browser) == []


def test_server_validation_errors_show_next_to_their_fields(
    keyed_stack: Stack, api: httpx.Client, browser: WebDriver,
) -> None:
    open_dashboard(browser, keyed_stack, "#/jobs")
    before = keyed_stack.writes(), api.get("/comparisons").json()["comparisons"]
    fill_form(browser, {"loss_scale.mode": "dynamic", "loss_scale.growth_steps": 0, "training.steps": 0,
                        "training.batch_size": 32})
    # POST /jobs names ["body", "training", "steps"]; POST /comparisons ["body", "spec", "training", "steps"].
    for button in ("submit-job", "compare-precisions"):
        by_testid(browser, button).click()
        for field in ("training.steps", "loss_scale.growth_steps"):
            error = wait_for(browser, shown(f"error-{field}"), 10, f"the error by {field} after {button}")
            assert "greater than or equal to 1" in error.text
            control = browser.find_element(By.CSS_SELECTOR, f'[data-field="{field}"]')
            assert control.get_attribute("aria-invalid") == "true"
            assert control.get_attribute("aria-describedby") == error.get_attribute("id")
            wrapper = control.find_element(By.XPATH, "..")
            assert wrapper.get_attribute("data-field-wrapper") == field
            assert error.find_element(By.XPATH, "..") == wrapper
        assert not by_testid(browser, "form-errors").is_displayed()
        assert not by_testid(browser, "error-training.batch_size").is_displayed()
    assert (keyed_stack.writes(), api.get("/comparisons").json()["comparisons"]) == before
    assert browser.current_url.endswith("#/jobs")
    screenshot(browser, "dashboard-form-errors.png")
    assert page_errors(browser) == []


def test_compare_precisions_shows_the_verdict_table_and_overlaid_losses(
    keyed_stack: Stack, api: httpx.Client, browser: WebDriver,
) -> None:
    open_dashboard(browser, keyed_stack, "#/jobs")
    fill_form(browser, {"name": "dashboard compare", "model.name": "mlp", "training.steps": 20,
                        "training.batch_size": 32})
    by_testid(browser, "compare-precisions").click()
    wait_for(browser, lambda d: "#/comparisons/" in d.current_url, 10, "the comparison page")
    comparison_id = browser.current_url.rsplit("/", 1)[-1]
    assert attr(browser, "comparison-page", "data-comparison-id") == comparison_id

    def finished(_: Any) -> dict[str, Any] | None:
        comparison: dict[str, Any] = api.get(f"/comparisons/{comparison_id}").json()
        return comparison if comparison["state"] == "done" else None

    comparison = wait_for(browser, finished, 120, "the comparison to finish")
    labels = [v["label"] for v in comparison["variants"]]
    assert len(labels) == 4 and comparison["spec"]["spec"]["training"]["steps"] == 20
    wait_for(browser, lambda d: attr(d, "comparison-page", "data-state") == "done"
             and attr(d, "chart-comparison-loss", "data-points") == str(4 * 20), 20, "every loss curve")
    assert attr(browser, "chart-comparison-loss", "data-series") == "4"
    assert by_testid(browser, "verdict").text == comparison["verdict"] != ""
    rows = browser.find_elements(By.CSS_SELECTOR, '[data-testid="variant-row"]')
    assert [r.find_element(By.CSS_SELECTOR, "th a").text for r in rows] == labels
    assert [r.get_attribute("data-job-id") for r in rows] == [v["job_id"] for v in comparison["variants"]]
    # Every number in the table reads as the CLI's table (mpjobs/contract/formats.py) writes it.
    cells = browser.execute_script("""return [...document.querySelectorAll('[data-testid="variant-row"]')]
        .map((row) => [...row.querySelectorAll("td.num")].map((td) => td.innerText));""")
    assert cells == [[or_dash(v["final_loss"], number), or_dash(v["loss_gap"], lambda gap: percent(gap, sign=True)),
                      or_dash(v["examples_per_sec"], rate), speed_cell(v, dash="–"),
                      or_dash(v["skipped_steps"], str), or_dash(v["peak_zero_grad_fraction"], percent),
                      or_dash(v["peak_excess_zero_fraction"], percent)] for v in comparison["variants"]]
    assert first_layer_cells(browser) == [first_layer_text(v) for v in comparison["variants"]]
    screenshot(browser, "dashboard-comparison.png")

    browser.get(f"{keyed_stack.base_url}/#/comparisons")
    wait_for(browser, lambda d: d.find_elements(
        By.CSS_SELECTOR, f'[data-testid="comparison-row"][data-comparison-id="{comparison_id}"]'), 10,
        "the comparison in the list")
    assert page_errors(browser) == []


def first_layer_text(variant: dict[str, Any]) -> str:
    """A comparison's "First layer to lose gradients" cell as the page writes it, for a variant that ended."""
    layer = variant["underflow_layer"]
    return "none" if layer is None else f"{layer} at step {variant['underflow_step']}"


def first_layer_cells(driver: WebDriver) -> list[str]:
    return list(driver.execute_script(
        """return [...document.querySelectorAll('[data-testid="underflow-layer"]')].map((c) => c.innerText);"""))


def layer_checks(api: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    """Every layer check of a job, page by page."""
    checks: list[dict[str, Any]] = []
    after = 0
    while True:
        page = api.get(f"/jobs/{job_id}/layers", params={"after": after, "limit": 100}).json()
        checks += page["checks"]
        if page["next_after"] is None:
            return checks
        after = page["next_after"]


def heat_cells(driver: WebDriver) -> list[list[Any]]:
    """Every heatmap cell, row by row: [layer, step, value ("" when none), level]."""
    return list(driver.execute_script("""return [...document.querySelectorAll('[data-testid="heat-cell"]')]
        .map((c) => [c.dataset.layer, Number(c.dataset.step), c.dataset.value, c.dataset.level]);"""))


def drawn(cells: list[list[Any]]) -> list[tuple[str, int, float | None]]:
    return [(layer, step, None if value == "" else float(value)) for layer, step, value, _ in cells]


def per_cell(checks: list[dict[str, Any]], layers: list[str], field: str) -> list[tuple[str, int, float | None]]:
    """The API's `field` for every heatmap cell: row by row (layer), then check by check."""
    return [(name, c["step"], {layer["name"]: layer for layer in c["layers"]}[name][field])
            for name in layers for c in checks]


def rows_of(driver: WebDriver, testid: str) -> list[dict[str, str]]:
    """Rows' layer, flags and text, read in one script call: a panel redrawn live cannot go stale mid-read."""
    return list(driver.execute_script(f"""return [...document.querySelectorAll('[data-testid="{testid}"]')]
        .map((r) => ({{layer: r.dataset.layer, flags: r.dataset.flags ?? "", text: r.innerText}}));"""))


def focused_layer(driver: WebDriver) -> str | None:
    """The layer of the row a link led to: focused and marked."""
    layer = driver.execute_script("""const row = document.activeElement;
        const led = row?.dataset?.testid === "layer-row" && row.classList.contains("targeted");
        return led ? row.dataset.layer : null;""")
    return None if layer is None else str(layer)


TINY_UNET = {"name": "conv3d_unet", "volume": 4, "filters": 2}
"""The seed's zero-gradient net (each output voxel's gradient 1/384³, under float16's smallest subnormal), at its
smallest: under mixed_float16 without loss scaling its gradients underflow from the first step."""


def test_the_layers_panel_and_the_comparison_name_the_layer_where_underflow_begins(
    keyed_stack: Stack, api: httpx.Client, browser: WebDriver,
) -> None:
    # The worker is held (SIGSTOP) until the float16 job's page has loaded, empty: every layer check
    # it then shows arrived live, as a `layers` event on the metrics stream.
    worker = keyed_stack.workers[0].pid
    os.killpg(worker, signal.SIGSTOP)
    try:
        wait_until(lambda: stopped(worker), 10, f"worker {worker} to stop", interval=0.001)
        created = api.post("/comparisons", json={
            "name": "dashboard layers",
            "spec": {"model": TINY_UNET, "dataset": {"samples": 8},
                     "training": {"steps": 3, "batch_size": 2, "optimizer": "sgd", "learning_rate": 0.1,
                                  "underflow_check_every": 1}},
            "variants": [{"precision_policy": "float32"}, {"precision_policy": "mixed_float16", "loss_scale": "none"}],
        })
        assert created.status_code == 201, created.text
        comparison_id = created.json()["id"]
        float32_job, half_job = (v["job_id"] for v in created.json()["variants"])
        open_dashboard(browser, keyed_stack, f"#/jobs/{half_job}")
        wait_for(browser, lambda d: attr(d, "layers-panel", "data-loaded") == "true"
                 and text_of(d, "stream-status") == "Live.", 20, "the empty Layers panel, live")
        assert text_of(browser, "layers-empty") == "No layer checks yet: the first is at step 1."
        assert attr(browser, "job-page", "data-state") == "queued"
    finally:
        os.killpg(worker, signal.SIGCONT)

    def finished() -> dict[str, Any] | None:
        comparison: dict[str, Any] = api.get(f"/comparisons/{comparison_id}").json()
        return comparison if comparison["state"] == "done" else None

    comparison = wait_until(finished, 240, "the comparison to finish")
    job = api.get(f"/jobs/{half_job}").json()
    assert job["state"] == "succeeded", job["error"]
    checks = layer_checks(api, half_job)
    layers = [layer["name"] for layer in checks[-1]["layers"]]
    assert [c["step"] for c in checks] == [1, 2, 3] and len(layers) > 5
    underflow_layer = job["summary"]["underflow_layer"]
    assert underflow_layer in layers and job["summary"]["underflow_step"] == 1

    # One heatmap row per layer, input side first; a cell per check; each the API's value, all of them live.
    wait_for(browser, lambda d: text_of(d, "stream-status") == "Run ended."
             and attr(d, "layers-panel", "data-job-state") == "succeeded"
             and attr(d, "layers-panel", "data-checks") == "3" and attr(d, "layers-heatmap", "data-columns") == "3",
             30, "every layer check drawn, and the job's end")
    assert attr(browser, "layers-panel", "data-streamed") == "3"
    assert [row["layer"] for row in rows_of(browser, "heat-row")] == layers
    excess = per_cell(checks, layers, "excess_zero_fraction")
    assert drawn(heat_cells(browser)) == excess
    assert any(value is None for _, _, value in excess)  # a layer with nothing to train: hatched
    assert {level for _, _, _, level in heat_cells(browser) if level != "none"} & {"4", "5"}  # the underflow: hot

    # The latest check's table flags the layer where underflow begins, the summary's own.
    table_rows = rows_of(browser, "layer-row")
    assert [row["layer"] for row in table_rows] == layers
    flagged = {row["layer"]: row["text"] for row in table_rows if "underflow begins here" in row["flags"]}
    assert underflow_layer in flagged and "underflow begins here" in flagged[underflow_layer]
    assert set(flagged) == {underflow_layer, checks[-1]["underflow_layer"]} - {None}
    retried = [c for c in checks if c["recovery"]]  # the first check to name a layer retries its step
    if retried:
        assert text_of(browser, "layers-recovery").startswith(
            f"At step {retried[0]['step']}, tried again at doubling loss scales, {underflow_layer}'s gradients")

    # A diagnosis that names a layer links to its row, on the same page.
    named = [d for d in job["summary"]["diagnoses"] if d["layer"]]
    assert named and underflow_layer in {d["layer"] for d in named}
    link = browser.find_element(By.CSS_SELECTOR, f'[data-testid="diagnosis-layer"][data-layer="{underflow_layer}"]')
    link.click()
    wait_for(browser, lambda d: focused_layer(d) == underflow_layer, 10, "the diagnosis's layer row")
    assert browser.current_url.endswith(f"#/jobs/{half_job}")

    # Activation headroom instead: the same grid, redrawn with each layer's doublings left.
    by_testid(browser, "layers-metric-headroom").click()
    wait_for(browser, lambda d: attr(d, "layers-heatmap", "data-metric") == "headroom", 10, "the headroom heatmap")
    assert drawn(heat_cells(browser)) == per_cell(checks, layers, "activation_headroom_log2")
    assert attr(browser, "layers-legend", "data-metric") == "headroom"
    screenshot(browser, "dashboard-layers.png")

    # float32 runs no layer checks, and its page says so.
    assert layer_checks(api, float32_job) == []
    open_dashboard(browser, keyed_stack, f"#/jobs/{float32_job}")
    wait_for(browser, lambda d: attr(d, "layers-panel", "data-loaded") == "true"
             and text_of(d, "layers-empty").startswith("Layer checks run"), 20, "the float32 job's Layers panel")
    assert text_of(browser, "layers-empty") == \
        "Layer checks run on the float32 check's steps under float16/bfloat16; this job has none."

    # The comparison names, per variant, the first layer to lose gradients, linked to that job's row.
    variants = comparison["variants"]
    assert [v["underflow_layer"] for v in variants] == [None, underflow_layer]
    open_dashboard(browser, keyed_stack, f"#/comparisons/{comparison_id}")
    wait_for(browser, lambda d: attr(d, "comparison-page", "data-state") == "done", 20, "the comparison page")
    assert first_layer_cells(browser) == ["none", f"{underflow_layer} at step 1"]

    def followed(driver: WebDriver) -> bool:
        if "#/comparisons/" in driver.current_url:  # a link found before a redraw is stale: find it again
            link = f'[data-job-id="{half_job}"] [data-testid="underflow-layer"] a'
            driver.find_element(By.CSS_SELECTOR, link).click()
        return focused_layer(driver) == underflow_layer

    wait_for(browser, followed, 30, "the variant's layer row on its job page")
    assert browser.current_url.endswith(f"#/jobs/{half_job}/layers/{underflow_layer}")
    assert attr(browser, "job-page", "data-job-id") == half_job
    assert page_errors(browser) == []


def test_the_loss_scale_axis_labels_the_powers_the_run_visited(
    keyed_stack: Stack, api: httpx.Client, browser: WebDriver,
) -> None:
    # From 2^32 the dynamic scale halves step after step down to what the gradients fit (near 2^17 for
    # this mlp), then holds there: a wide range whose most-visited scale must carry a label.
    steps = 40
    created = api.post("/jobs", json={
        "model": {"name": "mlp", "input_dim": 32, "hidden_units": 16}, "precision_policy": "mixed_float16",
        "loss_scale": {"mode": "dynamic", "initial_scale": 2.0**32, "growth_steps": 2000},
        "training": {"steps": steps, "batch_size": 16}, "dataset": {"samples": 256}})
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    assert keyed_stack.wait_for_state(api, job_id, {"succeeded", "failed"})["state"] == "succeeded"
    points = api.get(f"/jobs/{job_id}/metrics", params={"limit": steps}).json()["points"]
    at: dict[int, int] = {}
    for point in points:
        exponent = int(point["loss_scale"]).bit_length() - 1
        assert 2.0**exponent == point["loss_scale"]
        at[exponent] = at.get(exponent, 0) + 1
    assert max(at) - min(at) >= 12, at  # a range uPlot labels only every few powers of
    open_dashboard(browser, keyed_stack, f"#/jobs/{job_id}")
    wait_for(browser, lambda d: attr(d, "chart-loss-scale", "data-points") == str(steps)
             and attr(d, "chart-loss-scale", "data-ticks") not in (None, "", "[]"), 20, "the loss-scale chart")
    ticks = [int(t) for t in re.findall(r"-?\d+", attr(browser, "chart-loss-scale", "data-ticks") or "")]
    most = max(at, key=lambda e: (at[e], e))
    assert most in ticks, (ticks, at)
    assert set(ticks) <= set(at), "every label is a scale the run was at"
    assert len(ticks) >= 4 and ticks == sorted(ticks)


def test_the_job_page_charts_the_held_out_evaluations_and_states_them_in_the_summary(
    keyed_stack: Stack, api: httpx.Client, browser: WebDriver,
) -> None:
    created = api.post("/jobs", json={
        "model": {"name": "mlp", "input_dim": 8, "hidden_units": 16}, "dataset": {"samples": 256},
        "training": {"steps": 6, "batch_size": 16},
        "validation": {"split": 0.25, "metrics": ["accuracy"], "eval_every": 2}})
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    job = keyed_stack.wait_for_state(api, job_id, {"succeeded", "failed"})
    assert job["state"] == "succeeded", job["error"]
    open_dashboard(browser, keyed_stack, f"#/jobs/{job_id}")
    # Two series (loss, accuracy), each at steps 2, 4 and 6.
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '[data-testid="chart-validation"]')
             and attr(d, "chart-validation", "data-series") == "2"
             and attr(d, "chart-validation", "data-points") == "6", 20, "the held-out evaluation chart")
    summary = text_of(browser, "summary")
    assert "Held-out evaluation (final)" in summary and "on 64 held-out rows at step 6" in summary
    assert "192 rows trained on (64 held out)" in summary
    assert page_errors(browser) == []


def fp8_table(driver: WebDriver) -> list[dict[str, Any]]:
    """The FP8 panel's rows: layer, tensor, flags and each value cell's text, read in one script call."""
    return list(driver.execute_script("""return [...document.querySelectorAll('[data-testid="fp8-row"]')]
        .map((r) => ({layer: r.dataset.layer, tensor: r.dataset.tensor, flags: r.dataset.flags ?? "",
          cells: Object.fromEntries([...r.querySelectorAll("td[data-field]")]
            .map((td) => [td.dataset.field, td.textContent]))}));"""))


def finite(value: float | None) -> str:
    """An FP8 row's value as the panel shows it: null (not finite) says so."""
    return "non-finite" if value is None else number(value)


def test_the_fp8_panel_shows_each_fp8_layer_s_latest_scaling_state_and_its_range_use_over_steps(
    keyed_stack: Stack, api: httpx.Client, browser: WebDriver,
) -> None:
    created = api.post("/jobs", json={
        "model": {"name": "mlp", "input_dim": 16, "hidden_units": 32, "classes": 4}, "dataset": {"samples": 256},
        "precision_policy": "mixed_bfloat16", "fp8": {"amax_history_length": 4},
        "training": {"steps": 32, "batch_size": 16, "underflow_check_every": 10}})
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    open_dashboard(browser, keyed_stack, f"#/jobs/{job_id}")  # while it is queued or training: steps arrive live
    wait_for(browser, lambda d: attr(d, "job-page", "data-state") in ("succeeded", "failed")
             and text_of(d, "stream-status") == "Run ended." and attr(d, "fp8-panel", "data-step") == "32",
             120, "the job's end, its last step in the FP8 panel")
    job = api.get(f"/jobs/{job_id}").json()
    assert job["state"] == "succeeded", job["error"]
    points = api.get(f"/jobs/{job_id}/metrics", params={"after": 0, "limit": 1000}).json()["points"]
    assert [p["step"] for p in points] == list(range(1, 33))
    latest = points[-1]
    checked = [p for p in points if any(r.get("saturated_fraction") is not None for r in p["fp8"])][-1]
    assert checked["step"] == 30  # the shares shown are the latest checked step's, not the latest's

    # The summary's FP8 layers, a row per layer and tensor of the latest record, each cell its value.
    layers = job["summary"]["fp8"]["layers"]
    assert len(layers) == 2 and json.loads(attr(browser, "fp8-panel", "data-layers") or "") == layers
    assert attr(browser, "fp8-panel", "data-checked-step") == str(checked["step"])
    rows = fp8_table(browser)
    assert [(r["layer"], r["tensor"]) for r in rows] == [(r["layer"], r["tensor"]) for r in latest["fp8"]]
    assert {r["layer"] for r in rows} == set(layers)
    assert fp8_summary_words(job["summary"]["fp8"]) in text_of(browser, "summary")  # the CLI's line, word for word
    exact = {(r["layer"], r["tensor"]): r for r in checked["fp8"]}
    for shown_row, row in zip(rows, latest["fp8"], strict=True):
        counts = exact[(row["layer"], row["tensor"])]
        assert shown_row["cells"] == {
            "scale": finite(row["scale"]), "amax": finite(row["amax"]), "range_use": finite(row["range_use"]),
            "lag": or_dash(Fp8Tensor.model_validate(row).lag, number), "peak_age": str(row["peak_age"]),
            "saturated_fraction": or_dash(counts["saturated_fraction"], percent),
            "underflow_fraction": or_dash(counts["underflow_fraction"], percent)}, row
        assert ("saturating" in shown_row["flags"]) == (row["range_use"] is not None and row["range_use"] > 1)

    # One series per layer and tensor, a point per step where its range use is finite and positive.
    drawn = sum(1 for p in points for r in p["fp8"] if r["range_use"] is not None and r["range_use"] > 0)
    assert attr(browser, "chart-fp8-range", "data-series") == str(len(latest["fp8"]))
    assert attr(browser, "chart-fp8-range", "data-points") == str(drawn)
    assert page_errors(browser) == []
    screenshot(browser, "dashboard-fp8.png")
