"""Pure health checks: a snapshot (+ kernel-log XIDs) and limits -> findings.

A finding names the rule, the GPU and the observed value; `DRAIN` findings make the node
unhealthy, `WARN` findings are logged only. No I/O here: replay snapshots test all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Iterable

from . import xid as xidcat
from .snapshot import GpuState, NodeSnapshot


class Severity(IntEnum):
    WARN = 1
    DRAIN = 2


# Most severe first: the drain reason names the first DRAIN finding in this order.
RULE_ORDER = (
    "nvml-timeout",
    "nvml-error",
    "gpu-lost",
    "gpu-count",
    "cuda-init",
    "nvswitch-fabric",
    "xid",
    "recovery-action",
    "ecc-uncorrectable",
    "row-remap-failure",
    "row-remap-pending",
    "retired-pages-pending",
    "nvlink-down",
    "pcie-width",
    "hw-slowdown",
    "gpu-leftover-processes",
    "gpu-orphaned-memory",
)

RECOVERY_ACTIONS = {0: "none", 1: "gpu reset", 2: "node reboot", 3: "drain p2p", 4: "drain and reset"}
HW_SLOWDOWN = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")


@dataclass(frozen=True)
class Finding:
    """One check's verdict on one GPU (or the node)."""
    rule: str
    severity: Severity
    gpu: int | None
    detail: str
    observed: Any = None

    @property
    def summary(self) -> str:
        """Short and readable in `sinfo -R`, e.g. `xid 79 on gpu 3 (fallen off the bus)`."""
        if self.rule == "xid" or self.rule == "xid-app":
            return f"xid {self.observed} on gpu {self.gpu if self.gpu is not None else '?'} ({self.detail})"
        where = f"gpu {self.gpu} " if self.gpu is not None else ""
        return f"{self.rule}: {where}{self.detail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity.name.lower(),
            "gpu": self.gpu,
            "detail": self.detail,
            "observed": self.observed,
            "summary": self.summary,
        }


@dataclass
class Report:
    """All findings of one health check."""
    findings: list[Finding] = field(default_factory=list)
    gpus_seen: int = 0
    expected_gpus: int | None = None
    gpu_ids: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)  # index -> (UUID, PCI bus id)
    expected_source: str | None = None  # where the expected count came from (None: unknown or not asked)

    @property
    def healthy(self) -> bool:
        return not any(f.severity is Severity.DRAIN for f in self.findings)

    @property
    def worst(self) -> Finding | None:
        """The most severe finding: the one the drain reason names."""
        drains = [f for f in self.findings if f.severity is Severity.DRAIN]
        if not drains:
            return None
        return min(drains, key=lambda f: (RULE_ORDER.index(f.rule) if f.rule in RULE_ORDER else 99, f.gpu or 0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "gpus_seen": self.gpus_seen,
            "expected_gpus": self.expected_gpus,
            "expected_source": self.expected_source,
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass(frozen=True)
class Limits:
    """The warning thresholds; these defaults are the config's (`[health]`) too."""

    temperature_warn_c: float = 85.0
    nvlink_errors_warn: int = 1000
    ecc_corrected_warn: int = 10000

    @classmethod
    def from_health(cls, health: Any) -> Limits:
        return cls(health.temperature_warn_c, health.nvlink_errors_warn, health.ecc_corrected_warn)


def run_checks(
    snap: NodeSnapshot,
    expected_gpus: int | None = None,
    limits: Limits = Limits(),
    kernel_xids: Iterable[tuple[int | None, int, str]] = (),
) -> Report:
    """All checks. `kernel_xids` are (gpu index, xid code, detail) read since the cursor."""
    seen = len({g.index for g in snap.gpus})  # a GPU listed twice is one GPU
    report = Report(gpus_seen=seen, expected_gpus=expected_gpus,
                    gpu_ids={g.index: (g.uuid, g.pci_bus_id) for g in snap.gpus})
    add = report.findings.append
    if snap.nvml_error:
        add(Finding("nvml-error", Severity.DRAIN, None, f"NVML cannot start ({snap.nvml_error})", snap.nvml_error))
    elif expected_gpus is not None and seen < expected_gpus:
        add(Finding("gpu-count", Severity.DRAIN, None, f"found {seen} of {expected_gpus} GPUs", seen))
    for gpu in snap.gpus:
        report.findings.extend(check_gpu(gpu, limits))
    for gpu_index, code, detail in kernel_xids:
        report.findings.append(xid_finding(code, gpu_index, detail))
    return report


def xid_finding(code: int, gpu: int | None, detail: str = "") -> Finding:
    info = xidcat.classify(code, detail)
    severity = Severity.DRAIN if info.drains else Severity.WARN
    return Finding("xid" if info.drains else "xid-app", severity, gpu, info.meaning, code)


def check_gpu(g: GpuState, limits: Limits) -> list[Finding]:
    out: list[Finding] = []
    i = g.index

    def drain(rule: str, detail: str, observed: Any) -> None:
        out.append(Finding(rule, Severity.DRAIN, i, detail, observed))

    def warn(rule: str, detail: str, observed: Any) -> None:
        out.append(Finding(rule, Severity.WARN, i, detail, observed))

    if g.lost:
        drain("gpu-lost", "GPU is lost (NVML_ERROR_GPU_IS_LOST)", True)
        return out
    for event in g.xid_events:
        out.append(xid_finding(event.xid, i, event.detail or ""))
    if g.recovery_action is not None and g.recovery_action >= 1:
        drain("recovery-action", f"NVML asks for {RECOVERY_ACTIONS.get(g.recovery_action, 'recovery')}", g.recovery_action)
    if (g.ecc.volatile_uncorrected or 0) > 0:
        drain("ecc-uncorrectable", f"{g.ecc.volatile_uncorrected} volatile uncorrectable ECC errors", g.ecc.volatile_uncorrected)
    elif (g.ecc.aggregate_uncorrected or 0) > 0:
        warn("ecc-aggregate", f"{g.ecc.aggregate_uncorrected} uncorrectable ECC errors over the GPU's life", g.ecc.aggregate_uncorrected)
    if (g.ecc.volatile_corrected or 0) >= limits.ecc_corrected_warn:
        warn("ecc-corrected", f"{g.ecc.volatile_corrected} corrected ECC errors since boot", g.ecc.volatile_corrected)
    rr = g.remapped_rows
    if rr.failure:
        drain("row-remap-failure", "row remapping failed", True)
    if rr.pending:
        drain("row-remap-pending", "row remap pending (GPU reset needed)", True)
    if g.retired_pages.pending:
        drain("retired-pages-pending", "page retirement pending (GPU reset needed)", True)
    for link in g.nvlink:
        if link.active is False:
            drain("nvlink-down", f"NVLink {link.link} inactive", link.link)
        errors = sum(x or 0 for x in (link.replay_errors, link.recovery_errors, link.crc_errors))
        if errors >= limits.nvlink_errors_warn:
            warn("nvlink-errors", f"NVLink {link.link} has {errors} replay/recovery/CRC errors", errors)
    p = g.pcie
    if p.width is not None and p.max_width is not None and p.width < p.max_width:
        drain("pcie-width", f"PCIe link x{p.width} below x{p.max_width}", p.width)
    if p.gen is not None and p.max_gen is not None and p.gen < p.max_gen:
        warn("pcie-gen", f"PCIe gen {p.gen} below gen {p.max_gen} (normal at idle)", p.gen)
    reasons = set(g.clocks_event_reasons or ())
    hw = [r for r in HW_SLOWDOWN if r in reasons]
    if hw:
        drain("hw-slowdown", "clocks slowed by " + ",".join(hw), hw)
    for soft in ("sw_power_cap", "sw_thermal_slowdown", "gpu_idle"):
        if soft in reasons:
            warn("clocks", f"clocks event {soft}", soft)
    if g.temperature_c is not None and g.temperature_c >= limits.temperature_warn_c:
        warn("temperature", f"{g.temperature_c:g} C at or above {limits.temperature_warn_c:g} C", g.temperature_c)
    if g.persistence_mode is False:
        warn("persistence-mode", "persistence mode off (slower job start, lost state between jobs)", False)
    return out


def count_unknown_finding(tried: Iterable[str]) -> Finding:
    """No source gave the expected GPU count: the `gpu-count` rule cannot run. A warning (a job
    never fails for it) that names every source tried and the fix."""
    return Finding("gpu-count-unknown", Severity.WARN, None,
                   "expected GPU count unknown, a missing GPU goes unnoticed; tried " + "; ".join(tried)
                   + "; set [health] expected_gpus or make slurm.conf readable", None)


def timeout_report(timeout_s: float, expected_gpus: int | None) -> Report:
    """A hung NVML read is an unhealthy verdict of its own."""
    return Report(
        findings=[Finding("nvml-timeout", Severity.DRAIN, None, f"NVML read hung past {timeout_s:g} s", timeout_s)],
        expected_gpus=expected_gpus,
    )
