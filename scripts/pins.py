"""The pinned package set (requirements/<platform>.txt) and the installed one.

    python scripts/pins.py check [--lock F] # exit 1, listing the differences, unless they are equal
    python scripts/pins.py index-args cpu  # pip's configured indexes as uv flags (uv does not read pip.conf)

A lock lists every package of a platform with `==`; refresh them with `make lock`."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK_RECORD = ROOT / ".venv" / ".rlexp-lock"  # which lock scripts/install.sh installed
NOT_PINNED = {"rlexp"}  # this checkout, installed editable


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" not in line:
            sys.exit(f"{path}:{lineno}: not an exact pin (name==version): {raw!r}")
        name, version = line.split("==", 1)
        pins[normalize(name)] = version.split(";", 1)[0].strip()
    return pins


def installed() -> dict[str, str]:
    return {normalize(d.metadata["Name"]): d.version for d in metadata.distributions()}


def differences(pins: dict[str, str], have: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(set(pins) | set(have)):
        if name in NOT_PINNED:
            continue
        want, got = pins.get(name), have.get(name)
        if want is None:
            out.append(f"  {name}=={got} is installed but not pinned")
        elif got is None:
            out.append(f"  {name}=={want} is pinned but not installed")
        elif got != want:
            out.append(f"  {name}: installed {got}, pinned {want}")
    return out


def check(lock: Path | None = None) -> int:
    """`lock`: default, the one scripts/install.sh installed."""
    if lock is None:
        if not LOCK_RECORD.is_file():
            print(f"pins: {LOCK_RECORD} missing: .venv was not made by scripts/install.sh (make install)")
            return 1
        lock = ROOT / LOCK_RECORD.read_text().strip()
    diff = differences(read_lock(lock), installed())
    if diff:
        print(f"pins: the installed packages differ from {lock}:", *diff,
              "reinstall (rm -rf .venv && make install), or change the pins on purpose "
              "(requirements/*.in, then make lock)", sep="\n")
        return 1
    print(f"pins: {len(read_lock(lock))} installed packages match {lock}")
    return 0


def index_args(platform: str) -> list[str]:
    """`pip config list` as uv flags. On GPU, pip's find-links dirs are skipped: a local CPU
    build of torch there satisfies `torch==2.13.0` too."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True).stdout
    flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
    pairs: list[tuple[str, str]] = []  # in pip's order, once each (env and file may repeat)
    for line in out.splitlines():
        key, _, value = line.partition("=")
        option = flags.get(key.rsplit(".", 1)[-1])
        if option is None or (option == "--find-links" and platform == "gpu"):
            continue
        items = value.strip().strip("'\"").split()
        pairs += [(option, item) for item in items if (option, item) not in pairs]
    # pip's rule: the best version from any index (uv's default takes the first index that has it)
    return [arg for pair in pairs for arg in pair] + ["--index-strategy", "unsafe-best-match"]


def main() -> None:
    if sys.argv[1:2] == ["check"] and len(sys.argv) in (2, 4):
        sys.exit(check(Path(sys.argv[3]) if sys.argv[2:3] == ["--lock"] else None))
    if len(sys.argv) == 3 and sys.argv[1] == "index-args" and sys.argv[2] in ("cpu", "gpu"):
        print("\n".join(index_args(sys.argv[2])))
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main()
