"""The local GPU's fingerprint and the per-arch resource limits used to prune configs.

Limits are the CUDA programming guide's per-compute-capability table (shared memory a block can
opt into, registers, resident warps); they let the tuner reject a candidate before any GPU time,
and let `compile-check` judge candidates for GPUs that are not present.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dmattn_bench.space import arch_family


@dataclass(frozen=True)
class ArchLimits:
    """Per-block / per-SM limits of one compute capability."""

    arch: str  # e.g. "sm90"
    compute_capability: tuple[int, int]
    shared_memory_per_block: int  # bytes a block may opt into (cudaFuncSetAttribute maximum)
    registers_per_sm: int
    max_registers_per_thread: int
    max_warps_per_sm: int
    max_threads_per_block: int = 1024


# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
ARCH_LIMITS = {
    "sm80": ArchLimits("sm80", (8, 0), 163 * 1024, 65536, 255, 64),
    "sm86": ArchLimits("sm86", (8, 6), 99 * 1024, 65536, 255, 48),
    "sm89": ArchLimits("sm89", (8, 9), 99 * 1024, 65536, 255, 48),
    "sm90": ArchLimits("sm90", (9, 0), 227 * 1024, 65536, 255, 64),
    "sm120": ArchLimits("sm120", (12, 0), 99 * 1024, 65536, 255, 48),
}


def parse_arch(name: str) -> ArchLimits:
    """`"sm90"`, `"90"` or `"9.0"` -> its limits.

    Raises:
        ValueError: an arch that is not one of ARCH_LIMITS.
    """
    text = name.strip().lower().removeprefix("sm_").removeprefix("sm").replace(".", "")
    key = f"sm{text}"
    if key not in ARCH_LIMITS:
        raise ValueError(f"arch: got {name!r}, expected one of {', '.join(ARCH_LIMITS)}")
    return ARCH_LIMITS[key]


def search_section(limits: ArchLimits) -> str:
    """The search-space section (`configs/space/*.yaml`) for an arch."""
    return arch_family(*limits.compute_capability)


@dataclass(frozen=True)
class DeviceFingerprint:
    """What identifies a GPU for a dispatch table: a table tuned on another one is foreign."""

    name: str
    compute_capability: str  # "9.0"
    sm_count: int
    shared_memory_per_block: int  # opt-in bytes

    def to_dict(self) -> dict:
        return asdict(self)

    def slug(self) -> str:
        """A file-name-safe id, e.g. "nvidia-h200-sm90" (shipped tables are named by it)."""
        name = "".join(ch if ch.isalnum() else "-" for ch in self.name.lower()).strip("-")
        while "--" in name:
            name = name.replace("--", "-")
        if self == CPU_FINGERPRINT:
            return name
        return f"{name}-sm{self.compute_capability.replace('.', '')}"


CPU_FINGERPRINT = DeviceFingerprint("cpu-interpreter", "0.0", 0, 0)


def device_fingerprint(device: torch.device | str | None = None) -> DeviceFingerprint:
    """The fingerprint of a CUDA device, or CPU_FINGERPRINT for the interpreter."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda":
        return CPU_FINGERPRINT
    props = torch.cuda.get_device_properties(device)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or 0
    return DeviceFingerprint(props.name, f"{props.major}.{props.minor}", props.multi_processor_count, int(shared))


def local_limits(device: torch.device | str | None = None) -> ArchLimits | None:
    """Limits of the local GPU (its own reading of shared memory wins over the table)."""
    fingerprint = device_fingerprint(device)
    if fingerprint is CPU_FINGERPRINT:
        return None
    major, minor = (int(x) for x in fingerprint.compute_capability.split("."))
    known = ARCH_LIMITS.get(f"sm{major}{minor}")
    base = known or ArchLimits(f"sm{major}{minor}", (major, minor), fingerprint.shared_memory_per_block, 65536, 255, 48)
    if fingerprint.shared_memory_per_block:
        base = ArchLimits(base.arch, base.compute_capability, fingerprint.shared_memory_per_block,
                          base.registers_per_sm, base.max_registers_per_thread, base.max_warps_per_sm)
    return base


def _driver_version() -> str | None:
    """The NVIDIA driver version (e.g. "580.159.04") from nvidia-smi; None when unavailable."""
    import subprocess

    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip().splitlines()[0] if result.stdout.strip() else None


# The torch and triton releases this project runs on (pyproject's dependency ranges, which a test
# keeps equal to these): torch 2.13 / triton 3.9 on the CPU tier, torch 2.11 / triton 3.6 on the
# GPUs (H100, H200); between and at those ends, what the device image and the registry give.
TESTED_RELEASES = {"torch": ((2, 11), (2, 13)), "triton": ((3, 6), (3, 9))}


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '2.13.0+cpu' or '3.6.0'; None if unreadable."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def untested_releases(versions: dict[str, str | None] | None = None) -> list[str]:
    """One line per installed torch or triton outside `TESTED_RELEASES` (none when all are in)."""
    versions = versions or software_versions()
    lines = []
    for name, (low, high) in TESTED_RELEASES.items():
        release = _release(versions.get(name) or "")
        if release is None or not low <= release <= high:
            lines.append(f"{name} {versions.get(name)} is outside the releases dmattn-bench was tested on "
                         f"({low[0]}.{low[1]} to {high[0]}.{high[1]}); install one of those if anything fails")
    return lines


def software_versions() -> dict[str, str | None]:
    """torch, triton, CUDA runtime, driver and dmattn-bench versions (for tables)."""
    import triton

    from dmattn_bench.version import __version__

    driver = _driver_version() if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "driver": driver, "dmattn_bench": __version__}


@dataclass(frozen=True)
class DevicePeaks:
    """Dense bf16/fp16 tensor-core peak and HBM bandwidth: what `bench` measures floors against."""

    tensor_flops: float  # FLOP/s, without structured sparsity
    hbm_bytes_per_s: float

    def __str__(self) -> str:
        return f"{self.tensor_flops / 1e12:.0f} TFLOP/s, {self.hbm_bytes_per_s / 1e12:.2f} TB/s"


# NVIDIA's datasheets (dense, i.e. half the "with sparsity" figure), matched against the device
# name in this order (the first substring that matches wins).
_PEAKS = (
    ("H200", DevicePeaks(989e12, 4.8e12)),
    ("H100 PCIe", DevicePeaks(756e12, 2.0e12)),
    ("H100 NVL", DevicePeaks(835e12, 3.9e12)),
    ("H100", DevicePeaks(989e12, 3.35e12)),  # SXM5, "H100 80GB HBM3"
    ("A100-SXM4-80GB", DevicePeaks(312e12, 2.039e12)),
    ("A100-SXM4-40GB", DevicePeaks(312e12, 1.555e12)),
    ("A100 80GB PCIe", DevicePeaks(312e12, 1.935e12)),
)


def device_peaks(device: torch.device | str | None = None) -> DevicePeaks | None:
    """The datasheet peaks of the local GPU, or None (CPU, or a GPU not in the list)."""
    fingerprint = device_fingerprint(device)
    if fingerprint is CPU_FINGERPRINT:
        return None
    return next((peaks for name, peaks in _PEAKS if name in fingerprint.name), None)
