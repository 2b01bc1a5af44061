"""Temporary directories that a later run can clean up after a killed one.

A run's temporary state (the weight file in /dev/shm: gigabytes of RAM for a real model)
lives in a directory `<prefix><random>` holding a lock file that the owning process keeps
locked (`flock`) for as long as it lives. The kernel drops the lock when the process dies,
however it dies (SIGKILL included), so a directory whose lock can be taken has no owner:
`reap` removes it. No pid is compared, so a reused pid never keeps an orphan alive.

State that cannot live inside the directory (the /dev/shm segments vLLM's engine processes
create) is listed in its `.owned` file (`own`) and removed with it.

Where these directories go: under `$RLEXP_TEMP_DIR` when it is set (the weight files, vLLM's
sockets, and, through `TMPDIR`, every temporary file of the run's processes), so that one
run's temporary state is one directory of its own; else the weight files in /dev/shm (RAM)
and the rest in the system's temp dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)
TEMP_DIR_ENV = "RLEXP_TEMP_DIR"
LOCK = ".owner.lock"
OWNED = ".owned"  # paths outside the directory that go with it, one per line
UNLOCKED_GRACE_S = 60.0  # a directory is created before its lock: leave young ones alone


def temp_root() -> str:
    """Where a run's temporary directories go: `$RLEXP_TEMP_DIR`, else the system's temp dir."""
    return os.environ.get(TEMP_DIR_ENV) or tempfile.gettempdir()


def ram_root() -> str | None:
    """Where files meant to live in RAM go: `$RLEXP_TEMP_DIR` (put it on a tmpfs for that),
    else /dev/shm where there is one (None: the system's temp dir)."""
    if os.environ.get(TEMP_DIR_ENV):
        return os.environ[TEMP_DIR_ENV]
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def use_temp_root() -> None:
    """With `$RLEXP_TEMP_DIR` set: create it, and make it this process's and its children's
    temp dir (`TMPDIR`), so that nothing the run starts writes its temporary files elsewhere."""
    root = os.environ.get(TEMP_DIR_ENV)
    if root:
        os.makedirs(root, exist_ok=True)
        os.environ["TMPDIR"] = root
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def owned_tempdir(prefix: str, parent: str | None = None) -> tuple[Path, int]:
    """A new directory under `parent` (default: `temp_root()`), locked by this process;
    returns it and the lock's file descriptor (closing it releases the lock)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=parent or temp_root()))
    fd = os.open(directory / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return directory, fd


def owned_ram_dir(prefix: str) -> tuple[Path, int]:
    """`owned_tempdir` in RAM (`ram_root`), once the directories of `prefix` that dead runs
    left there are removed."""
    shm = ram_root()
    reap(prefix, shm)
    return owned_tempdir(prefix, shm)


def own(directory: Path, paths: Iterable[str]) -> None:
    """Record `paths` outside `directory` as its own: removed with it."""
    with open(directory / OWNED, "a") as f:
        f.writelines(f"{p}\n" for p in paths)


def remove(directory: Path, lock: int | None = None) -> None:
    """Remove `directory` and the paths it owns, then release its lock."""
    with contextlib.suppress(OSError):
        for path in (directory / OWNED).read_text().splitlines():
            with contextlib.suppress(OSError):
                os.unlink(path)
    shutil.rmtree(directory, ignore_errors=True)
    if lock is not None:
        os.close(lock)


def reap(prefix: str, parent: str | None = None) -> list[Path]:
    """Remove the directories `<parent>/<prefix>*` whose owner has died; returns them."""
    root = Path(parent or temp_root())
    removed = []
    for directory in root.glob(prefix + "*"):
        if directory.is_dir() and not _owned(directory):
            remove(directory)
            removed.append(directory)
    if removed:
        log.info("removed %d directories left by killed runs: %s", len(removed),
                 ", ".join(str(d) for d in removed))
    return removed


def _owned(directory: Path) -> bool:
    try:
        fd = os.open(directory / LOCK, os.O_RDWR)
    except FileNotFoundError:  # being created, or left by a version without locks
        try:
            return time.time() - directory.stat().st_mtime < UNLOCKED_GRACE_S
        except FileNotFoundError:
            return True  # removed meanwhile by its owner
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # its owner is alive
    finally:
        os.close(fd)  # also releases the lock if we took it
    return False
