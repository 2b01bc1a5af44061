"""rlexp's two changes to verifiers' behaviour (verifiers 0.4), made in the verifiers worker's
process (rlexp/envs/verifiers_worker.py) when it starts serving:

- a harness program (a PEP 723 script) runs with the worker's own Python when its venv has
  every package the script declares (`run_scripts_locally`, `missing_packages`), instead of
  letting uv resolve them (which needs the network);
- the `index` verifiers' chat program leaves in each tool call of its earlier replies is
  dropped from its requests (`drop_tool_call_indexes`): rlexp's server refuses it.

Like the worker, it runs in verifiers' own venv and imports nothing of rlexp (stdlib and
verifiers only): the worker loads it by its path."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path

_DEPENDENCIES = re.compile(r"^# dependencies = (\[.*\])$", re.M)


def missing_packages(script: bytes) -> list[str]:
    """The PEP 723 dependencies of `script` this Python does not have (as pinned there)."""
    from importlib.metadata import PackageNotFoundError, version

    m = _DEPENDENCIES.search(script.decode(errors="replace"))
    missing = []
    for req in json.loads(m.group(1)) if m else []:
        try:
            from packaging.requirements import Requirement

            parsed = Requirement(req)
            name, spec = parsed.name, parsed.specifier
        except ImportError:  # no packaging: the name alone
            name, spec = re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0], None
        try:
            have = version(name)
        except PackageNotFoundError:
            missing.append(req)
            continue
        if spec is not None and not spec.contains(have, prereleases=True):
            missing.append(f"{req} (have {have})")
    return missing


def run_scripts_locally() -> None:
    """The subprocess runtime runs a harness program (a PEP 723 script) with this Python when
    this venv has every package the script declares; otherwise as verifiers does (uv resolves
    them, which needs the network the first time)."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    original = SubprocessRuntime.prepare_uv_script
    if getattr(original, "_rlexp_local", False):
        return
    directory = Path(SubprocessRuntime.scripts_dir + "-local")

    async def prepare_uv_script(self, script, env=None, *, activate=True):
        data = script.encode() if isinstance(script, str) else script
        missing = missing_packages(data)
        if missing:
            logging.getLogger("rlexp.verifiers").warning(
                "harness script needs %s, not in %s: verifiers' uv resolves it", missing, sys.prefix)
            return await original(self, script, env, activate=activate)
        path = directory / f"{hashlib.sha256(data).hexdigest()}.py"
        if not path.exists():
            directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return [sys.executable, str(path)]

    prepare_uv_script._rlexp_local = True  # type: ignore[attr-defined]
    SubprocessRuntime.prepare_uv_script = prepare_uv_script  # type: ignore[method-assign]


def drop_tool_call_indexes() -> None:
    """verifiers' chat program sends its earlier replies back with an `index` in each tool
    call (the OpenAI SDK's stream accumulation keeps it). It means nothing in a request, and
    rlexp's server refuses fields it does not know (400): it is dropped on the way out."""
    from verifiers.v1.dialects.chat import ChatDialect

    original = ChatDialect.apply_overrides
    if getattr(original, "_rlexp", False):
        return

    def apply_overrides(self, body, model, sampling):
        body = original(self, body, model, sampling)
        for message in body.get("messages") or []:
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            for call in calls or []:
                if isinstance(call, dict):
                    call.pop("index", None)
        return body

    apply_overrides._rlexp = True  # type: ignore[attr-defined]
    ChatDialect.apply_overrides = apply_overrides  # type: ignore[method-assign]
