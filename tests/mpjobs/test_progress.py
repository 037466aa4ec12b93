"""The progress view (CLI and client): a burst of records is drawn once it stops, and the phases after training named.

Reported: `submit --watch` sat at 251/300 for seconds after step 300 had arrived (records in a burst
were not drawn until the view closed), while the job measured its speed, unnamed. In Jupyter the same view
updates one output in place.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator

import pytest

from mpjobs._progress import NotebookOut, ProgressView
from scripts.stack import wait_until

TOTAL = 300
SPEED_CHECK = "measuring speed against float32"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def record(step: int) -> dict[str, object]:
    return {"step": step, "time": 1000.0 + step / 100, "loss": 1.0 / step, "loss_scale": 2.0**15,
            "grad_norm": 0.5, "skipped": False}


@pytest.fixture
def views() -> Iterator[list[ProgressView]]:
    made: list[ProgressView] = []
    yield made
    for view in made:
        view.close()


def burst(view: ProgressView, steps: range) -> None:
    for step in steps:
        view.step(record(step))


def test_the_last_step_of_a_burst_is_drawn_without_waiting_for_the_next_record(views: list[ProgressView]) -> None:
    out = Terminal()
    views.append(view := ProgressView(out, TOTAL, interval=5.0))
    burst(view, range(1, TOTAL + 1))  # all within the redraw interval: only the first is drawn at once
    wait_until(lambda: f"{TOTAL}/{TOTAL} 100%" in out.getvalue(), 2, "the burst's last step on the bar")
    assert not view.closed


def test_after_the_last_step_the_bar_names_what_the_job_does(views: list[ProgressView]) -> None:
    out = Terminal()
    views.append(view := ProgressView(out, TOTAL, interval=5.0, phase_of=lambda: SPEED_CHECK))
    burst(view, range(1, TOTAL + 1))
    bar = f"{TOTAL}/{TOTAL} 100%  loss 0.003333  scale 32768  grad norm 0.5  {SPEED_CHECK}…"
    wait_until(lambda: bar in out.getvalue(), 4, "the phase on the bar")
    view.close()
    assert out.getvalue().endswith("…\n")


def test_without_a_terminal_the_phase_is_one_line_and_steps_are_not_repeated(views: list[ProgressView]) -> None:
    out = io.StringIO()
    views.append(view := ProgressView(out, TOTAL, interval=0.2, phase_of=lambda: SPEED_CHECK))
    burst(view, range(1, TOTAL + 1))
    wait_until(lambda: f"phase: {SPEED_CHECK}\n" in out.getvalue(), 4, "the phase line")
    lines = out.getvalue().splitlines()
    assert lines.count(f"phase: {SPEED_CHECK}") == 1
    steps = [line.split()[1] for line in lines if line.startswith("step ")]
    assert steps == sorted(set(steps), key=steps.index) and steps[-1] == f"{TOTAL}/{TOTAL}"


def test_while_the_job_trains_no_phase_is_shown(views: list[ProgressView]) -> None:
    out = Terminal()
    views.append(view := ProgressView(out, TOTAL, interval=5.0, phase_of=lambda: "training"))
    burst(view, range(1, 11))
    wait_until(lambda: "10/300" in out.getvalue(), 2, "the last step")
    time.sleep(1.5)  # past PHASE_AFTER_S: the view asked, and "training" is not worth saying
    assert "training…" not in out.getvalue() and "ETA" in out.getvalue()


class Handle:
    """An IPython DisplayHandle as the view uses it: each update replaces the output."""

    def __init__(self) -> None:
        self.shown: list[str] = []

    def update(self, data: dict[str, str], raw: bool) -> None:
        assert raw
        self.shown.append(data["text/plain"])


def test_in_jupyter_one_output_shows_the_state_lines_and_the_bar_as_a_terminal_would(
    views: list[ProgressView],
) -> None:
    handle = Handle()
    views.append(view := ProgressView(NotebookOut(handle), TOTAL, interval=5.0))
    view.state("running", "started")
    burst(view, range(1, TOTAL + 1))
    view.state("succeeded", f"finished {TOTAL} steps")
    view.close()
    bar = f"[{'#' * 24}] {TOTAL}/{TOTAL} 100%  loss 0.003333  scale 32768  grad norm 0.5  ETA 0:00"
    assert handle.shown[-1] == f"state: running (started)\n{bar}\nstate: succeeded (finished {TOTAL} steps)"
    assert all("\r" not in text and "\x1b" not in text for text in handle.shown)
