"""Hugging Face hub ids for models and datasets: the one owner of the hub logic.

`resolve(name, revision, repo_type)` turns a `model.path` or a `data.source.name` into a local
directory, once, on the driver, before any engine or trainer starts; every process then gets
that directory. A local directory that exists wins; a name that looks local (`/`, `.`, `~`) or
is not an `org/name` id is returned as given, for the caller's own "not found" error; an id is
resolved with `huggingface_hub.snapshot_download` into the hub cache, so HF_HOME, HF_HUB_CACHE,
HF_HUB_OFFLINE, HF_ENDPOINT and tokens (HF_TOKEN, `hf auth login`) work as everywhere else. Its
errors (offline and not cached, no such repo, gated, no such revision, no network) become one
line, a `ConfigError`. huggingface_hub is imported only here and only for an id (about 0.3 s);
this module imports nothing heavy."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rlexp.errors import ConfigError

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Snapshot:
    path: str  # a local directory (or, where `name` was neither a directory nor an id, `name` as given)
    commit: str | None  # the hub commit the directory holds; None for a local directory


def is_hub_id(name: str) -> bool:
    """`org/name`, and not a path that looks local (starting with `/`, `.` or `~`)."""
    return not name.startswith(("/", ".", "~")) and _HUB_ID.fullmatch(name) is not None


def snapshot_commit(path: str) -> str | None:
    """The commit of a hub-cache snapshot directory (`<cache>/models--org--name/snapshots/<commit>`);
    None for any other directory."""
    p = Path(path)
    return p.name if p.parent.name == "snapshots" and _COMMIT.fullmatch(p.name) else None


def resolve(name: str, revision: str | None = None, repo_type: str = "model", key: str = "model.path",
            revision_key: str = "model.revision") -> Snapshot:
    """`name` as a local directory where one exists, else as a hub id at `revision` (a branch,
    tag or commit; None: main), downloaded into the hub cache if it is not there (not with
    HF_HUB_OFFLINE=1). `key` / `revision_key` name the config keys in errors."""
    local = Path(name).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ConfigError(f"{revision_key}={revision} is a hub revision, but {key}={name} is a local "
                              f"directory (which wins over a hub id): unset {revision_key}")
        return Snapshot(str(local), None)
    if not is_hub_id(name):
        return Snapshot(name, None)
    path = _snapshot_download(name, revision, repo_type, key, revision_key)
    return Snapshot(path, snapshot_commit(path))


def _snapshot_download(repo_id: str, revision: str | None, repo_type: str, key: str,
                       revision_key: str) -> str:
    from huggingface_hub import constants, is_offline_mode, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{key}={repo_id}" + (f" ({revision_key}={revision})" if revision else "")
    page = f"{constants.ENDPOINT}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    download = (f"hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}"
                f"{f' --revision {revision}' if revision else ''}")
    cache = constants.HF_HUB_CACHE
    try:
        return snapshot_download(repo_id, repo_type=repo_type, revision=revision)
    except IncompleteSnapshotError as e:
        raise ConfigError(f"{what}: {_one_line(e)}") from None
    except LocalEntryNotFoundError as e:
        if is_offline_mode():
            raise ConfigError(f"{what}: not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE=1 forbids "
                              f"downloading it: download it once where there is network (`{download}`, "
                              f"with the same HF_HOME / HF_HUB_CACHE), or unset HF_HUB_OFFLINE") from None
        raise ConfigError(f"{what}: not in the Hugging Face cache {cache}, and the hub "
                          f"({constants.ENDPOINT}) cannot be reached ({_one_line(e.__cause__ or e)}): "
                          f"check the network (HF_ENDPOINT, proxy), or download it once where there is "
                          f"network (`{download}`) into that cache") from None
    except GatedRepoError:
        raise ConfigError(f"{what}: a gated repo: accept its terms at {page}, then log in "
                          f"(`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{what}: no such {repo_type} on the hub ({page}), or a private one this token "
                          f"cannot see (log in: `hf auth login`, or set HF_TOKEN), and no local directory "
                          f"of that name either") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{what}: the repo has no revision {revision!r} (a branch, tag or commit of "
                          f"{page})") from None
    except HFValidationError as e:
        raise ConfigError(f"{key}={repo_id}: not a local directory, nor a valid hub id "
                          f"({_one_line(e)})") from None
    except HfHubHTTPError as e:
        raise ConfigError(f"{what}: the hub refused it ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
