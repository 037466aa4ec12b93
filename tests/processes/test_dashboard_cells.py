"""The comparison table's Held-out cell in headless Chromium: the report's `held_out` verdict when a variant
carries one, else the variant job's final evaluation, else "–"; numbers as mpjobs/contract/formats.py writes them."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from selenium.webdriver.chrome.webdriver import WebDriver

from mpjobs.contract.formats import number
from scripts.stack import ROOT
from tests.browser import headless_chromium


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def static_origin() -> Iterator[str]:
    """app/static over HTTP, so the browser imports comparisons.js as the dashboard does."""
    handler = functools.partial(_QuietHandler, directory=str(ROOT / "app" / "static"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def chromium() -> Iterator[WebDriver]:
    with headless_chromium() as driver:
        yield driver


def cells(driver: WebDriver, origin: str, rows: list[list[Any]]) -> list[dict[str, str]]:
    """heldOutCell(variant, job) for each [variant, job]: its text and data-source."""
    driver.get(f"{origin}/js/dom.js")  # a page of that origin, to import the module from
    result = driver.execute_async_script("""
        const [rows, done] = arguments;
        import("/js/comparisons.js").then((c) => done(rows.map(([v, job]) => {
          const td = c.heldOutCell(v, job);
          return { text: td.textContent, source: td.dataset.source };
        })), (error) => done({ error: String(error) }));
    """, rows)
    assert isinstance(result, list), result
    return result


def test_the_held_out_cell_prefers_the_reports_verdict_then_the_jobs_evaluation(
        static_origin: str, chromium: WebDriver) -> None:
    verdict = {"metric": "accuracy", "value": 0.91234, "float32_value": 0.9204, "difference": -0.00806,
               "low": -0.0213, "high": 0.00517}
    evaluation = {"step": 20, "loss": 0.312345, "metrics": {"accuracy": 0.90625, "mae": 0.000123456},
                  "examples": 64}
    rows = [
        [{"held_out": verdict}, {"summary": {"validation": evaluation}}],  # the report's verdict wins
        [{"held_out": {**verdict, "difference": None}}, None],
        [{"held_out": {"metric": "accuracy"}}, {"summary": {"validation": evaluation}}],  # incomplete: ignored
        [{}, {"summary": {"validation": evaluation}}],
        [{"held_out": None}, {"summary": {"validation": None}}],
        [{}, None],
    ]
    shown = cells(chromium, static_origin, rows)
    interval = f"{number(verdict['low'])} to {number(verdict['high'])}"
    job_text = (f"loss {number(evaluation['loss'])}, accuracy {number(0.90625)}, mae {number(0.000123456)}")
    assert shown == [
        {"text": f"accuracy {number(0.91234)} (-0.00806, {interval})", "source": "report"},
        {"text": f"accuracy {number(0.91234)} ({interval})", "source": "report"},
        {"text": job_text, "source": "job"},
        {"text": job_text, "source": "job"},
        {"text": "–", "source": "none"},
        {"text": "–", "source": "none"},
    ]
    assert job_text == "loss 0.3123, accuracy 0.9063, mae 1.235e-4"  # the shared rules (a tie rounds away from 0)
