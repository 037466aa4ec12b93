"""One number, one text: the CLI's formats (mpjobs/contract/formats.py) and the dashboard's (app/static/js/dom.js)
give the same text for the same values. The JavaScript runs in the headless Chromium the dashboard test uses."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from selenium.webdriver.chrome.webdriver import WebDriver

from mpjobs.contract.formats import number, percent, rate, ratio, speed_words
from scripts.stack import ROOT
from tests.browser import headless_chromium

SHARES = [
    0.0, -0.0, 0.00053, -0.00053, 5.3e-6, -3.9e-9, 1e-12, 0.008, -0.0123, 0.0996, -0.0996, 0.09949, 0.1, 0.25,
    0.4567, -0.5, 0.995, 0.997, 0.9999, 1.0, 1.004, 1.5, -2.5, 123.456, 1e25,
    0.0125, 0.125, -0.0125, 0.00125,  # ties: 1.25% and 12.5% are exact in binary
]
NUMBERS = [0.0, 2.58149, -2.58149, 0.000123456, 0.00099996, 0.001, 999999.6, 1234567.8, 32768.0, 1.0, 12345.67,
           1e-9, 1.25, 0.3, 1e30, 4.0e12]
RATES = [0.0, 0.8125, 3.14159, 42.46, 99.96, 99.4, 100.0, 1234.5, 14921.7, 2500000.4, 0.000123]
RATIOS = [1.0, 1.3, 0.05, 0.0456, 0.0949, 0.0996, 2.4, 1.125, 0.001234, 12.3456]
SPEEDS = [(4.2, 3.9, 4.5, "slower"), (0.5, 0.4, 0.625, "faster"), (1.04, 0.97, 1.11, "none"),
          (25.8, 23.8, 26.7, "slower"), (0.125, 0.1, 0.15, "faster"), (1.005, 0.995, 1.015, "none")]


def test_percent_keeps_two_significant_digits_and_never_reads_zero_or_all_for_a_value_that_is_not() -> None:
    assert [percent(s) for s in (0.0, -0.0, 0.00053, 0.0996, 0.25, 0.997, 1.0, 1.5)] == [
        "0%", "0%", "0.053%", "10%", "25%", "99%", "100%", "150%"]
    assert [percent(s, sign=True) for s in (0.0, -0.0, 0.00053, -0.00053, -3.9e-9, 0.123)] == [
        "0%", "0%", "+0.053%", "-0.053%", "-0.00000039%", "+12%"]
    assert percent(0.0125) == "1.3%" and percent(0.125) == "13%"  # ties round away from zero, as in JavaScript


def test_numbers_rates_and_speedups() -> None:
    assert [number(v) for v in (2.58149, 0.000123456, 1234567.8, 32768.0, 0.00099996, 999999.6)] == [
        "2.581", "1.235e-4", "1.235e+6", "32768", "1e-3", "1000000"]
    assert [rate(v) for v in (14921.7, 100.0, 99.96, 42.46, 0.8125)] == ["14,922", "100", "100", "42.5", "0.813"]
    assert [ratio(v) for v in (1.3, 1.0, 0.0996, 0.0949, 0.001234)] == ["1.30×", "1.00×", "0.10×", "0.095×",
                                                                       "0.0012×"]


def test_speed_words_state_the_measurements_call_and_interval() -> None:
    assert speed_words(4.2, 3.9, 4.5, "slower") == "4.20× slower than float32 (3.90–4.50×)"
    assert speed_words(0.5, 0.4, 0.625, "faster") == "2.00× faster than float32 (1.60–2.50×)"
    # The call is the measurement's: a median of 1.04 inside the noise reads as no difference, with its figures.
    assert speed_words(1.04, 0.97, 1.11, "none") == \
        "no measurable speed difference from float32 (step time 0.97–1.11× float32's)"


@pytest.fixture(scope="module")
def static_server() -> Iterator[str]:
    """app/static over HTTP, so the browser can import dom.js as the dashboard does."""
    handler = functools.partial(_QuietHandler, directory=str(ROOT / "app" / "static"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    with headless_chromium() as driver:
        yield driver


@pytest.mark.processes
def test_the_dashboard_shows_every_value_as_the_cli_does(static_server: str, browser: WebDriver) -> None:
    browser.get(f"{static_server}/js/dom.js")  # any page of that origin, to import the module from
    shown = browser.execute_async_script("""
        const [tables, done] = arguments;
        import("/js/dom.js").then((dom) => done({
          percent: tables.shares.map((v) => dom.fmtPercent(v)),
          signed: tables.shares.map((v) => dom.fmtPercent(v, true)),
          number: tables.numbers.map((v) => dom.fmtNumber(v)),
          number2: tables.numbers.map((v) => dom.fmtNumber(v, 2)),
          number6: tables.numbers.map((v) => dom.fmtNumber(v, 6)),
          rate: tables.rates.map((v) => dom.fmtRate(v)),
          ratio: tables.ratios.map((v) => dom.fmtRatio(v)),
          speed: tables.speeds.map((v) => dom.fmtSpeed(...v)),
        }), (error) => done({ error: String(error) }));
    """, {"shares": SHARES, "numbers": NUMBERS, "rates": RATES, "ratios": RATIOS, "speeds": SPEEDS})
    assert shown == {
        "percent": [percent(v) for v in SHARES],
        "signed": [percent(v, sign=True) for v in SHARES],
        "number": [number(v) for v in NUMBERS],
        "number2": [number(v, 2) for v in NUMBERS],
        "number6": [number(v, 6) for v in NUMBERS],
        "rate": [rate(v) for v in RATES],
        "ratio": [ratio(v) for v in RATIOS],
        "speed": [speed_words(*v) for v in SPEEDS],
    }
