"""The command's parser, with no server: its defaults (the client's), the global options on either side of the
command, and the command each name runs."""

from __future__ import annotations

import pytest

from mpjobs import DEFAULT_TIMEOUT_S, DEFAULT_URL
from mpjobs.cli import build_parser
from mpjobs.cli.commands import cmd_cancel, cmd_submit, cmd_watch
from mpjobs.cli.plan_commands import cmd_plan


def test_the_defaults_are_the_clients_unless_the_environment_sets_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPJOBS_URL", raising=False)
    monkeypatch.delenv("MPJOBS_API_KEY", raising=False)
    args = build_parser().parse_args(["watch", "j1"])
    assert (args.url, args.api_key, args.timeout, args.interval) == (DEFAULT_URL, None, DEFAULT_TIMEOUT_S, 5.0)
    assert (args.run, args.job_id) == (cmd_watch, "j1")
    text = build_parser().format_help()
    assert "(default: $MPJOBS_URL or http://127.0.0.1:8000)" in text and "(default: 30)" in text
    monkeypatch.setenv("MPJOBS_URL", "http://api.example:9000")
    monkeypatch.setenv("MPJOBS_API_KEY", "k1")
    args = build_parser().parse_args(["watch", "j1"])
    assert (args.url, args.api_key) == ("http://api.example:9000", "k1")


def test_global_options_go_before_or_after_the_command() -> None:
    before = build_parser().parse_args(["--url", "http://a:1", "--timeout", "2", "cancel", "j1", "--wait"])
    after = build_parser().parse_args(["cancel", "j1", "--wait", "--url", "http://a:1", "--timeout", "2"])
    for args in (before, after):
        assert (args.url, args.timeout, args.run, args.job_id, args.wait) == ("http://a:1", 2.0, cmd_cancel, "j1", True)


def test_submit_watch_takes_the_interval_of_its_progress_lines() -> None:
    args = build_parser().parse_args(["submit", "--model", "mlp", "--watch", "--interval", "0"])
    assert (args.run, args.model, args.watch, args.interval) == (cmd_submit, "mlp", True, 0.0)


def test_plan_reads_a_job_and_compare_plan_asks_for_the_plan_variant() -> None:
    args = build_parser().parse_args(["plan", "j1", "--json"])
    assert (args.run, args.job_id, args.json) == (cmd_plan, "j1", True)
    assert build_parser().parse_args(["compare", "--model", "mlp", "--plan"]).plan == "auto"
    assert build_parser().parse_args(["compare", "--model", "mlp"]).plan is None
