"""Real-browser check of the MLflow UI for a sweep: serve the store on loopback, open the
sweep's comparison view (the Model training runs page in chart mode, the sweep's child runs
grouped by the swept keys, eval accuracy by step, one line per run; rlexp saved the view when
the sweep started), check that every child run has its line in the chart, save a screenshot.

    .venv/bin/python scripts/ui_check.py sweeps/<sweep dir> [--screenshot docs/mlflow_compare.png]

Needs Debian's `chromium` (scripts/install_chromium.sh). Exit status 0 when every child run
has a drawn line whose legend names it."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mlflow.tracking import MlflowClient

from rlexp.tracking.mlflow_tracker import experiment_id
from rlexp.tracking.sweep import read_sweep, save_compare_view

METRIC = "eval/accuracy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1600,1000",
           "--virtual-time-budget=25000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def drawn_runs(dom: str, metric: str = METRIC) -> set[str]:
    """Run names whose legend entry in the `metric` chart has a line of its colour drawn
    through at least two points."""
    legend = re.findall(r'stroke: (rgb\([^)]*\));"></path></svg><span[^>]*>([^<]*) \(' + re.escape(metric)
                        + r"\)</span>", dom)
    lines = re.findall(r'<path class="js-line" d="([^"]*)" style="[^"]*stroke: (rgb\([^)]*\)); '
                       r"stroke-opacity: 1;", dom)
    return {name for color, name in legend if any(c == color and "L" in d for d, c in lines)}


def check(sweep_dir: str, screenshot: str | None) -> list[str]:
    """Child runs without a line in the comparison chart (empty: all drawn)."""
    info = read_sweep(sweep_dir)
    if info is None:
        sys.exit(f"{sweep_dir}: no rlexp_sweep.json (not a sweep dir)")
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    children = client.search_runs([info["experiment_id"]],
                                  f"tags.`mlflow.parentRunId` = '{info['parent_run_id']}'")
    view = info.get("compare_view")
    if view is None:  # a sweep started before rlexp saved views
        experiment_id(client, client.get_experiment(info["experiment_id"]).name)
        view = save_compare_view(client, info["experiment_id"], info["parent_run_id"],
                                 info.get("varying", []))
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", info["tracking_uri"],
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
        url = f"http://127.0.0.1:{port}{view}"
        drawn = drawn_runs(chromium("--dump-dom", url).stdout)
        if screenshot:
            Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
            chromium(f"--screenshot={Path(screenshot).resolve()}", url)
        missing = [c.info.run_name for c in children if c.info.run_name not in drawn]
        print(f"{url}: {len(children) - len(missing)}/{len(children)} child runs drawn in the {METRIC} chart"
              + (f"; missing {missing}" if missing else ""))
        return missing
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir")
    ap.add_argument("--screenshot", default=None)
    args = ap.parse_args()
    sys.exit(1 if check(args.sweep_dir, args.screenshot) else 0)


if __name__ == "__main__":
    main()
