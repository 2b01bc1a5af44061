"""python -m rlexp.tinker [key=value ...]   (= rlexp tinker): the Tinker API server (server.py)."""

from __future__ import annotations

import asyncio

import hydra
from omegaconf import DictConfig

import rlexp.config  # noqa: F401 - registers the ${rlexp.*} resolvers before Hydra composes


@hydra.main(version_base="1.3", config_path="pkg://rlexp.conf", config_name="tinker")
def main(cfg: DictConfig) -> None:
    from rlexp.console import quiet_third_party
    from rlexp.tinker.server import serve

    quiet_third_party()
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
