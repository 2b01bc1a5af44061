"""Real-browser check of the MLflow UI for a sweep: serve the store on loopback, load the
sweep's parent run page in headless Chromium, check that every child run is listed, and
save a screenshot.

    .venv/bin/python scripts/ui_check.py sweeps/<sweep dir> [--screenshot docs/mlflow_sweep.png]

Needs Debian's `chromium` (scripts/install_chromium.sh). Exit status 0 when every child
run name is on the page."""

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

from rlexp.tracking.sweep import read_sweep


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900",
           "--virtual-time-budget=20000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def check(sweep_dir: str, screenshot: str | None) -> list[str]:
    """Child run names missing from the parent run's page (empty: all shown)."""
    info = read_sweep(sweep_dir)
    if info is None:
        sys.exit(f"{sweep_dir}: no rlexp_sweep.json (not a sweep dir)")
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    children = client.search_runs([info["experiment_id"]],
                                  f"tags.`mlflow.parentRunId` = '{info['parent_run_id']}'")
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
        url = f"http://127.0.0.1:{port}/#/experiments/{info['experiment_id']}/runs/{info['parent_run_id']}"
        dom = chromium("--dump-dom", url).stdout
        visible = re.sub(r"<(script|style).*?</\1>", "", dom, flags=re.S)
        text = " ".join(re.sub(r"<[^>]+>", " ", visible).split())
        if screenshot:
            Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
            chromium(f"--screenshot={Path(screenshot).resolve()}", url)
        missing = [c.info.run_name for c in children if c.info.run_name not in text]
        print(f"{url}: {len(children) - len(missing)}/{len(children)} child runs shown"
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
