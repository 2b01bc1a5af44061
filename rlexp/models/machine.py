"""The machine kind: what decides the bytes of a float32 computation on this CPU besides the code
and the package versions.

torch picks its own vectorised kernels by CPU level (AVX2, AVX-512; `get_cpu_capability`), but
its GEMMs are MKL's, and MKL picks a code path by vendor as well as by instruction set: its
branches other than AUTO and COMPATIBLE "are available only for Intel processors" (oneMKL
developer guide, Specifying Code Branches), so an AMD CPU with AVX-512 runs other sgemm code
than an Intel one with the same flags. MKL's branches and oneDNN's ISAs are further split by
extension (AVX512_E1 = + VNNI, then BF16, FP16, AMX; avx2_vnni, avx512_core_bf16,
avx512_core_amx). A kind is therefore the vendor, the CPU level and which of those extensions
are present (`KERNEL_FLAGS`). Measured (docs/models-and-data.md, Reproducibility): the default
tiny model's first warm-start op to differ between two MKL branches is its first addmm."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# /proc/cpuinfo flags that select other MKL branches or oneDNN ISAs on x86-64
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
                "avx_vnni_int8", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


@dataclass(frozen=True)
class MachineKind:
    """A machine kind, or the kind a reference was made on: there `extensions` None means they
    were not recorded, and the reference holds on any CPU of that vendor and level."""

    vendor: str                         # /proc/cpuinfo vendor_id: GenuineIntel, AuthenticAMD, ...
    level: str                          # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, ...
    extensions: tuple[str, ...] | None  # the KERNEL_FLAGS this CPU has, in that order

    def __str__(self) -> str:
        shown = "extensions not recorded" if self.extensions is None else "+".join(self.extensions)
        return f"{self.vendor} {self.level} ({shown or 'no kernel extensions'})"

    def holds_on(self, here: MachineKind) -> bool:
        """Whether bytes made on this kind are the ones `here` makes."""
        return ((self.vendor, self.level) == (here.vendor, here.level)
                and self.extensions in (None, here.extensions))


@functools.cache
def machine_kind() -> MachineKind:
    import torch

    vendor, flags = _cpuinfo(Path("/proc/cpuinfo"))
    return MachineKind(vendor, torch.backends.cpu.get_cpu_capability(),
                       tuple(f for f in KERNEL_FLAGS if f in flags))


def _cpuinfo(path: Path) -> tuple[str, set[str]]:
    """The first processor's vendor_id and flags ("unknown" and none where the file is absent)."""
    vendor, flags = "unknown", set()
    if path.exists():
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id" and vendor == "unknown":
                vendor = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return vendor, flags
