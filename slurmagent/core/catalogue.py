"""The catalogue of health checks: every check's name, the layers it runs in, what its findings
do, its kill switch and the checkers that have the same check (docs/admin/health.md's table and
`slurmagent check --list` print it; a test keeps them equal)."""

from __future__ import annotations

from .check_spec import LAYERS, CheckSpec
from .node_catalogue import NODE_CHECKS

__all__ = ["LAYERS", "CheckSpec", "CATALOGUE", "enabled", "runs", "by_name", "RULE_CHECK"]

_NVML_LAYERS = LAYERS  # NVML's own checks run wherever NVML is read
_BETWEEN_JOBS = ("prolog", "epilog", "healthcheck")

_GPU_CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("gpu-nvml-presence", _NVML_LAYERS, "drain", True,
              "NVML starts and answers in time, no GPU is lost, as many GPUs as expected (rules nvml-timeout, "
              "nvml-error, gpu-lost, gpu-count; gpu-count-unknown warns)", ("GCM", "CycleCloud")),
    CheckSpec("gpu-xid", _NVML_LAYERS, "drain", True,
              "XIDs from NVML events and the kernel log: a reset/reboot/hardware XID drains (xid), an application "
              "XID warns (xid-app)", ("CycleCloud",)),
    CheckSpec("gpu-nvml-recovery-action", _NVML_LAYERS, "drain", True,
              "NVML's GPU recovery action >= 1 (recovery-action)", ()),
    CheckSpec("gpu-nvml-memory-errors", _NVML_LAYERS, "drain", True,
              "volatile uncorrectable ECC, row remap failure or pending, retired pages pending drain; lifetime or "
              "many corrected ECC errors warn", ("CTK", "GCM", "CycleCloud")),
    CheckSpec("gpu-nvml-nvlink", _NVML_LAYERS, "drain", True,
              "an inactive NVLink drains (nvlink-down); many replay/recovery/CRC errors warn", ("CTK", "GCM", "CycleCloud")),
    CheckSpec("gpu-nvml-pcie", _NVML_LAYERS, "drain", True,
              "PCIe link narrower than its maximum drains (pcie-width); a lower generation warns", ()),
    CheckSpec("gpu-nvml-clocks", _NVML_LAYERS, "drain", True,
              "a hardware slowdown / power brake clocks event drains (hw-slowdown); SW clocks events and high "
              "temperature warn", ("GCM",)),
    CheckSpec("gpu-nvml-persistence-mode", _NVML_LAYERS, "warn", True,
              "persistence mode off (persistence-mode)", ()),
    CheckSpec("gpu-leftover-processes", _BETWEEN_JOBS, "drain", True,
              "compute processes on a GPU that no running job of the node owns (after [health] leftover_grace_s, "
              "allowlist [health] gpu_process_allowlist); the epilog only records what its job left", ("GCM",)),
    CheckSpec("gpu-orphaned-memory", ("prolog", "healthcheck"), "drain", True,
              "GPU memory used beyond reserved memory and every process's share by more than "
              "[health] orphaned_memory_mib", ("GCM",)),
    CheckSpec("nvswitch-fabric", ("prolog", "healthcheck", "resume"), "drain", True,
              "the GPU's NVSwitch fabric (where NVML reports one) not completed or completed with an error; "
              "systems without a fabric report nothing", ()),
    CheckSpec("cuda-init", ("healthcheck", "resume"), "drain", True,
              "cuInit and cuDeviceGetCount through libcuda in a child under [health] cuda_timeout_s fail, or see "
              "fewer devices than NVML (prolog: the first of each boot until CUDA was found working, every one with "
              "[health] cuda_in_prolog)", ()),
)

CATALOGUE: tuple[CheckSpec, ...] = _GPU_CHECKS + NODE_CHECKS


def enabled(spec_name: str, on: tuple[str, ...], off: tuple[str, ...]) -> bool:
    """Whether a check runs at all under the `[checks]` switches (its layers apart)."""
    spec = by_name().get(spec_name)
    if spec is None:
        return spec_name in on
    if spec_name in off:
        return False
    return spec.default_on or spec_name in on


_BY_NAME = {spec.name: spec for spec in CATALOGUE}


def by_name() -> dict[str, CheckSpec]:
    return _BY_NAME


# The finding rules of core/checks.py and core/gpu_occupancy.py, by the check they belong to.
RULE_CHECK = {
    "nvml-timeout": "gpu-nvml-presence", "nvml-error": "gpu-nvml-presence", "gpu-lost": "gpu-nvml-presence",
    "gpu-count": "gpu-nvml-presence", "gpu-count-unknown": "gpu-nvml-presence",
    "xid": "gpu-xid", "xid-app": "gpu-xid",
    "recovery-action": "gpu-nvml-recovery-action",
    "ecc-uncorrectable": "gpu-nvml-memory-errors", "ecc-aggregate": "gpu-nvml-memory-errors",
    "ecc-corrected": "gpu-nvml-memory-errors", "row-remap-failure": "gpu-nvml-memory-errors",
    "row-remap-pending": "gpu-nvml-memory-errors", "retired-pages-pending": "gpu-nvml-memory-errors",
    "nvlink-down": "gpu-nvml-nvlink", "nvlink-errors": "gpu-nvml-nvlink",
    "pcie-width": "gpu-nvml-pcie", "pcie-gen": "gpu-nvml-pcie",
    "hw-slowdown": "gpu-nvml-clocks", "clocks": "gpu-nvml-clocks", "temperature": "gpu-nvml-clocks",
    "persistence-mode": "gpu-nvml-persistence-mode",
    "gpu-leftover-processes": "gpu-leftover-processes",
    "gpu-orphaned-memory": "gpu-orphaned-memory",
    "nvswitch-fabric": "nvswitch-fabric",
    "cuda-init": "cuda-init",
}


def runs(spec_name: str, layer: str | None, on: tuple[str, ...], off: tuple[str, ...]) -> bool:
    """Whether a check runs in `layer` (None: `slurmagent check`, every enabled check)."""
    spec = by_name().get(spec_name)
    if spec is None or not enabled(spec_name, on, off):
        return False
    return layer is None or layer in spec.layers


def list_text() -> str:
    """`slurmagent check --list`: one line per check (name, layers, severity, default, anchors)."""
    rows = [("check", "layers", "severity", "default", "also in")]
    for s in CATALOGUE:
        rows.append((s.name, ",".join(s.layers), s.severity, "on" if s.default_on else "off",
                     ",".join(s.anchors) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows) + "\n"


def markdown_table() -> str:
    """The table of docs/admin/health.md (between `<!-- BEGIN catalogue -->` and `<!-- END catalogue -->`)."""
    names = ("CTK", "GCM", "CycleCloud", "NHC")
    rows = ["| check | layers | severity | default | what | " + " | ".join(names) + " |",
            "|---|---|---|---|---|" + "---|" * len(names)]
    for s in CATALOGUE:
        marks = " | ".join("yes" if n in s.anchors else "" for n in names)
        rows.append(f"| `{s.name}` | {', '.join(s.layers)} | {s.severity} | {'on' if s.default_on else 'off'} | "
                    f"{s.what} | {marks} |")
    return "\n".join(rows) + "\n"
