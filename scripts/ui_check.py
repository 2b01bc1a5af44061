"""Real-browser check of the MLflow UI for a sweep: serve the store on loopback, open the
sweep's comparison view (the Model training runs page in chart mode, the sweep's child runs
grouped by the swept keys, eval accuracy by step, one line per run; rlexp saved the view when
the sweep started), wait until every child run has its line in the chart, save a screenshot.

    .venv/bin/python scripts/ui_check.py sweeps/<sweep dir> [--screenshot docs/mlflow_compare.png]

Needs Debian's `chromium` (scripts/install_chromium.sh), driven over the DevTools protocol on
a pipe (no extra Python package). The check polls the page's DOM until every child run has a
drawn line whose legend names it: how long the UI takes to draw does not matter. --timeout is
only a failsafe against a page that never draws them; then the report names the runs drawn so
far. Exit status 0 when every child run has its line."""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from mlflow.tracking import MlflowClient

from rlexp.tracking.mlflow_tracker import experiment_id
from rlexp.tracking.sweep import read_sweep, save_compare_view

METRIC = "eval/accuracy"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-pipe"]
POLL_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DevTools:
    """Headless Chromium driven over --remote-debugging-pipe: the browser reads JSON commands
    from its fd 3 and writes replies and events to its fd 4, each message ended by a NUL byte."""

    def __init__(self, user_data_dir: str, call_timeout: float = 120.0):
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        # sh hands the pipes, given as its stdin and stdout, to Chromium as fds 3 and 4
        launch = ["sh", "-c", 'exec "$@" 3<&0 4>&1 </dev/null >/dev/null', "sh",
                  "chromium", *CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}", "about:blank"]
        self.proc = subprocess.Popen(launch, stdin=cmd_r, stdout=out_w, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._last_id = 0
        self.call_timeout = call_timeout

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and return its result, skipping the events that come before it."""
        self._last_id += 1
        msg = {"id": self._last_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        data = json.dumps(msg).encode() + b"\0"
        try:
            while data:
                data = data[os.write(self._cmd_w, data):]
        except BrokenPipeError:
            raise self._gone(method) from None
        while True:
            reply = self._message(method)
            if reply.get("id") == self._last_id:
                if "error" in reply:
                    raise RuntimeError(f"Chromium: {method}: {reply['error']}")
                return reply["result"]

    def _message(self, method: str) -> dict:
        while b"\0" not in self._buf:
            if not select.select([self._out_r], [], [], self.call_timeout)[0]:
                raise TimeoutError(f"Chromium did not answer {method} in {self.call_timeout:.0f} s")
            chunk = os.read(self._out_r, 1 << 20)
            if not chunk:
                raise self._gone(method)
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def _gone(self, method: str) -> RuntimeError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        return RuntimeError(f"Chromium closed its DevTools pipe during {method} "
                            f"(exit status {self.proc.poll()}; 127: no chromium on PATH)")

    def open_page(self, url: str, width: int = 1600, height: int = 1000) -> str:
        """Open `url` in a new tab with a `width` x `height` viewport; the session id that
        commands for that tab carry."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        self.call("Page.navigate", {"url": url}, session)
        return session

    def evaluate(self, session: str, expression: str):
        reply = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        return reply["result"].get("value")

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)


def drawn_runs(dom: str, metric: str = METRIC) -> set[str]:
    """Run names whose legend entry in the `metric` chart has a line of its colour drawn
    through at least two points."""
    legend = re.findall(r'stroke: (rgb\([^)]*\));"></path></svg><span[^>]*>([^<]*) \(' + re.escape(metric)
                        + r"\)</span>", dom)
    lines = re.findall(r'<path class="js-line" d="([^"]*)" style="[^"]*stroke: (rgb\([^)]*\)); '
                       r"stroke-opacity: 1;", dom)
    return {name for color, name in legend if any(c == color and "L" in d for d, c in lines)}


def page_state(dom: str, metric: str = METRIC) -> str:
    """What the page shows, in a few words, for a report on a page that never drew every line."""
    legend = len(re.findall(r"<span[^>]*>[^<]* \(" + re.escape(metric) + r"\)</span>", dom))
    lines = len(re.findall(r'<path class="js-line" d="[^"]*L', dom))
    title = re.search(r"<title>([^<]*)</title>", dom)
    return (f"page {title.group(1) if title else '(no title)'!r}, {len(dom)} characters of DOM, "
            f"{legend} legend entries for {metric}, {lines} js-line paths through 2+ points")


def wait_for_lines(devtools: DevTools, session: str, names: set[str], timeout: float) -> tuple[set[str], str]:
    """Poll the page until every run in `names` has its line drawn; (the runs drawn, the last
    DOM read). Returns early only at the failsafe `timeout` (seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        dom = devtools.evaluate(session, "document.documentElement.outerHTML") or ""
        drawn = drawn_runs(dom)
        if names <= drawn or time.monotonic() > deadline:
            return drawn, dom
        time.sleep(POLL_S)


@contextlib.contextmanager
def mlflow_server(tracking_uri: str) -> Iterator[int]:
    """An MLflow server of `tracking_uri` on a free loopback port, up (its /health answers)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
           "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    sys.exit("the MLflow server did not come up")
                time.sleep(1)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def sweep_view(sweep_dir: str) -> tuple[dict, list]:
    """The sweep's info (with its saved comparison view's route) and its child runs."""
    info = read_sweep(sweep_dir)
    if info is None:
        sys.exit(f"{sweep_dir}: no rlexp_sweep.json (not a sweep dir)")
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    children = client.search_runs([info["experiment_id"]],
                                  f"tags.`mlflow.parentRunId` = '{info['parent_run_id']}'")
    if info.get("compare_view") is None:  # a sweep started before rlexp saved views
        experiment_id(client, client.get_experiment(info["experiment_id"]).name)
        info["compare_view"] = save_compare_view(client, info["experiment_id"], info["parent_run_id"],
                                                 info.get("varying", []))
    return info, children


def check(sweep_dir: str, screenshot: str | None, timeout: float = 300.0) -> list[str]:
    """Child runs without a line in the comparison chart (empty: all drawn)."""
    info, children = sweep_view(sweep_dir)
    names = {c.info.run_name for c in children}
    with mlflow_server(info["tracking_uri"]) as port, tempfile.TemporaryDirectory() as profile:
        url = f"http://127.0.0.1:{port}{info['compare_view']}"
        devtools = DevTools(profile)
        try:
            session = devtools.open_page(url)
            start = time.monotonic()
            drawn, dom = wait_for_lines(devtools, session, names, timeout)
            waited = time.monotonic() - start
            if screenshot:
                png = devtools.call("Page.captureScreenshot", {"format": "png"}, session)["data"]
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                Path(screenshot).write_bytes(base64.b64decode(png))
        finally:
            devtools.close()
    missing = [c.info.run_name for c in children if c.info.run_name not in drawn]
    print(f"{url}: {len(children) - len(missing)}/{len(children)} child runs drawn in the {METRIC} chart"
          + (f"; missing {missing}" if missing else f" ({waited:.0f} s after opening the page)"))
    if missing:
        print(f"gave up after {waited:.0f} s (--timeout {timeout:.0f}); last seen: {page_state(dom)}")
    return missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir")
    ap.add_argument("--screenshot", default=None)
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="failsafe: seconds to wait for the lines before reporting the runs drawn so far")
    args = ap.parse_args()
    sys.exit(1 if check(args.sweep_dir, args.screenshot, args.timeout) else 0)


if __name__ == "__main__":
    main()
