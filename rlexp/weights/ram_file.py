"""`weight_transfer=ram_file`: same node, no GPU. One safetensors file in RAM (/dev/shm), mapped
once and overwritten in place at every sync (one copy per tensor); the engine maps the same
file and loads from views of it."""

from __future__ import annotations

from pathlib import Path

from rlexp import orphans
from rlexp.errors import ConfigError
from rlexp.weights.files import WEIGHTS_FILE, SharedFile
from rlexp.weights.protocols import ClusterShape, LoadsWeightFiles, NamedTensors


class RamFileTransport:
    """The weights as a safetensors file in a RAM-backed directory, rewritten in place; the
    engine loads it (vLLM: mapped by its workers, no file parsing; HF: `read_shared`)."""

    PREFIX = "rlexp-weights-"
    engine_backend = None
    sends_from_driver = False  # a trainer group's weights too (they reach this process on the CPU)
    sends_adapter = False  # the policy's full tensors

    def __init__(self, directory: str | None = None, cluster: ClusterShape | None = None):
        """`directory`: where the file goes (None: a fresh one in RAM, under /dev/shm or
        `$RLEXP_TEMP_DIR` (rlexp/orphans.py), which only this node's engines can read)."""
        self._lock: int | None = None
        if directory is None:
            if cluster is not None and cluster.multi_node:
                raise ConfigError("weight_transfer=ram_file writes the weights into this node's RAM; "
                                  "rollout replicas run on other nodes: use weight_transfer=object_store "
                                  "(or auto), or give weight_transfer.directory on a shared file system")
            self.directory, self._lock = orphans.owned_ram_dir(self.PREFIX)  # and those of killed runs go
        else:
            self.directory = Path(directory)
        self.file = SharedFile(self.directory / WEIGHTS_FILE)

    async def transfer(self, weights: NamedTensors, engine: LoadsWeightFiles, version: int) -> None:
        self.file.write((name, t.to("cpu", copy=False)) for name, t in weights)
        await engine.load_weights(self.directory, version)

    def close(self) -> None:
        orphans.remove(self.directory, self._lock)
        self._lock = None
