"""The dashboard's stream reader (app/static/js/api.js `followMetrics`, run by Node) resumes after an `error` event
and after a 503 at the stream limit: from the last step it received, each step once, until `end`."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from scripts.stack import ROOT

NODE_FOLLOW = """
globalThis.sessionStorage = { getItem: () => null, removeItem: () => {}, setItem: () => {} };
const base = process.argv[1];
const realFetch = fetch;
globalThis.fetch = (path, options) => realFetch(base + path, options);
const { followMetrics } = await import(process.argv[2]);
const events = [], statuses = [];
const ended = await followMetrics("j", { after: 0, signal: new AbortController().signal,
  onEvent: (e) => events.push([e.event, e.id]), onStatus: (s) => statuses.push(s) });
console.log(JSON.stringify({ ended, events, statuses }));
"""


def metrics(step: int) -> str:
    return f'id: {step}\nevent: metrics\ndata: {{"step": {step}}}\n\n'


class FakeStreams(BaseHTTPRequestHandler):
    """Answers in turn: steps 1-2 then `error` (too_slow); a 503 at the stream limit; step 3 and `end`."""

    answers: list[str] = []

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        self.answers.append(parse_qs(urlsplit(self.path).query)["after"][0])
        turn = len(self.answers)
        if turn == 2:
            body = json.dumps({"detail": "This API process already serves 2 live streams"}).encode()
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        events = (metrics(1) + metrics(2) + 'event: error\ndata: {"reason": "too_slow", "detail": "behind"}\n\n'
                  if turn == 1 else metrics(3) + 'event: end\ndata: {"state": "succeeded"}\n\n')
        body = events.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    FakeStreams.answers = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeStreams)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()


def test_the_dashboard_resumes_after_an_error_event_and_a_503_each_step_once(server: ThreadingHTTPServer) -> None:
    node = shutil.which("node")
    assert node, "the dashboard's JavaScript test needs Node (`make install` installs it)"
    base = f"http://127.0.0.1:{server.server_address[1]}"
    module = (ROOT / "app" / "static" / "js" / "api.js").as_uri()
    out = subprocess.run([node, "--input-type=module", "-e", NODE_FOLLOW, base, module], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    seen = json.loads(out)
    assert seen["ended"] == "end"
    assert [e for e in seen["events"] if e[0] == "metrics"] == [["metrics", "1"], ["metrics", "2"], ["metrics", "3"]]
    assert "error" not in [e[0] for e in seen["events"]], "the error event is the reader's, not the page's"
    assert FakeStreams.answers == ["0", "2", "2"], "resumed after the last step received, then again after the 503"
    assert seen["statuses"] == ["live", "reconnecting", "reconnecting", "live"]
