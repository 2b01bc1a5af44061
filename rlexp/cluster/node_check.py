"""Every node that holds a part of the run can read what the run loads from disk (the model,
the checkpoint it resumes from), checked before any replica or rank starts: on a cluster
without a shared file system a replica would otherwise fail minutes later, on its node, with
an error far from the cause."""

from __future__ import annotations

import os
from typing import Any

from rlexp.errors import ConfigError


def listing(path: str) -> dict[str, int]:
    """The size of each file `path` holds directly (or of `path`, a file), each opened to
    read: an OSError when that fails."""
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    sizes = {}
    for file in files:
        if os.path.isfile(file):
            with open(file, "rb"):
                sizes[os.path.basename(file)] = os.path.getsize(file)
    return sizes


def differences(expected: dict[str, tuple[str, dict[str, int]]]) -> list[str]:
    """Where this process does not see what the driver saw (`expected`: name -> (path, the
    driver's listing)), one line per path."""
    problems = []
    for name, (path, files) in expected.items():
        try:
            seen = listing(path)
        except OSError as e:
            where = f" ({e.filename})" if e.filename != path else ""
            problems.append(f"{name}={path}: {e.strerror or e}{where}")
            continue
        missing = sorted(set(files) - set(seen))
        resized = sorted(f for f in set(files) & set(seen) if files[f] != seen[f])
        if missing:
            problems.append(f"{name}={path}: missing {', '.join(missing[:5])}" + " ..." * (len(missing) > 5))
        if resized:
            problems.append(f"{name}={path}: other sizes than the driver's: {', '.join(resized[:5])}")
    return problems


def check_nodes_read(paths: dict[str, str], node_ids: list[str], timeout_s: float) -> None:
    """One zero-CPU task pinned on each of `node_ids` lists and opens the files of `paths`
    (name -> file or directory) and compares them with what this process sees; a ConfigError
    names every node that sees less or other files."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    expected = {name: (path, listing(path)) for name, path in paths.items()}
    probe: Any = ray.remote(num_cpus=0, max_retries=0)(differences)
    answers = ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                       .remote(expected) for node in node_ids], timeout=timeout_s)
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    bad = [f"node {node} ({addresses.get(node, '?')}): " + "; ".join(problems)
           for node, problems in zip(node_ids, answers) if problems]
    if bad:
        raise ConfigError("every node that runs a rollout replica or a trainer rank must see the "
                          "driver's model (and checkpoint, on resume) at the same path, e.g. on a shared "
                          "file system; these do not:\n  " + "\n  ".join(bad))
