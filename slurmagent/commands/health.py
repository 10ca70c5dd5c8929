"""Gather a node's health: snapshot (replay file or NVML with a deadline) + kernel-log XIDs -> Report.

The healthy path imports no google library and makes no slurmctld or network call. The
expected GPU count (`expected`), first answer wins: `[health] expected_gpus`; the node's gpu
gres in slurm.conf/gres.conf at `[slurm] conf`, $SLURM_CONF, the configless cache
(`slurm.commands.CONF_SEARCH`), /etc/slurm; else the larger of the machine type's GPUs (from
the per-boot cache `expiry-watch` writes) and the NVIDIA GPUs on the PCI bus. None of them: a
`gpu-count-unknown` warning that names what was tried, never silence.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Protocol

from ..gpu import kernlog
from ..core.checks import Limits, Report, count_unknown_finding, run_checks, timeout_report
from ..state.config import Config
from ..errors import NvmlTimeout
from ..core.kernel_xid import KernelXid, map_to_gpus
from ..slurm.commands import CONF_SEARCH, conf_candidates, gres_gpu_count
from ..state.host import BOOT_ID_PATH, boot_id
from ..core.snapshot import NodeSnapshot, load


class SnapshotReader(Protocol):
    """Reads this node's GPUs under a hard deadline (nvml_deadline.ThreadSafeReader)."""

    def read(self, timeout_s: float, hostname: str | None = None) -> NodeSnapshot: ...


@dataclass(frozen=True)
class CountSources:
    """Where the expected GPU count is looked for on this machine: data, so tests point every
    source at a temporary tree (they never touch /run, /var, /sys or the real boot id)."""
    conf_search: tuple[Path, ...] = CONF_SEARCH
    sysfs: Path = Path("/sys")
    boot_id_path: str = BOOT_ID_PATH
    env: Mapping[str, str] | None = None  # None: os.environ when asked


SOURCES = CountSources()


@dataclass(frozen=True)
class Expected:
    """The expected GPU count, where it came from, and (when unknown) every source tried."""
    count: int | None
    source: str = ""
    tried: tuple[str, ...] = ()


def expected(cfg: Config, node: str, sources: CountSources | None = None) -> Expected:
    """First answer wins: the config, then Slurm's files (the prolog finds the configless cache
    through $SLURM_CONF at once). Without them the larger of the machine type and the PCI bus:
    a GPU missing at boot is absent from the bus, a GPU NVML lost is still on it."""
    src = sources or SOURCES
    if cfg.health.expected_gpus:
        return Expected(cfg.health.expected_gpus, "[health] expected_gpus")
    env = os.environ if src.env is None else src.env
    count, conf, tried = gres_gpu_count(node, conf_candidates(cfg.slurm.conf, env, src.conf_search))
    if count:
        return Expected(count, f"gres of {node} in {conf}")
    # Slurm is silent: the fallbacks only, for start-up speed of the healthy prolog
    from ..core.machine_gpus import gpus_for_machine_type
    from ..gpu.pci import count_nvidia_gpus
    from ..state import machine_type

    cache = machine_type.cache_file(cfg.state_path(node))
    mtype = machine_type.read(cache, boot_id(src.boot_id_path))
    by_type = gpus_for_machine_type(mtype) if mtype else None
    if mtype is None:
        tried.append(f"machine type (no cache of this boot at {cache}: expiry-watch writes it)")
    elif by_type is None:
        tried.append(f"machine type {mtype} (no fixed GPU count)")
    on_bus = count_nvidia_gpus(src.sysfs)
    if not on_bus:
        tried.append(f"PCI bus ({'no NVIDIA GPU' if on_bus == 0 else 'cannot read'} under {src.sysfs}/bus/pci/devices)")
    if by_type or on_bus:
        if (by_type or 0) >= (on_bus or 0):
            return Expected(by_type, f"machine type {mtype}")
        return Expected(on_bus, "NVIDIA GPUs on the PCI bus")
    return Expected(None, "", ("[health] expected_gpus (0: unset)", *tried))


def read_snapshot(cfg: Config, node: str | None, reader: SnapshotReader | None = None) -> NodeSnapshot:
    """The replay file when `[health] snapshot` is set, else NVML in an abandonable child:
    forked (single-threaded callers: the hooks), or from `reader` (a threaded daemon)."""
    if cfg.health.snapshot:
        return load(cfg.node_path(cfg.health.snapshot, node))
    if reader is not None:
        return reader.read(cfg.health.timeout_s, hostname=node)
    from ..gpu.nvml_deadline import read_snapshot_with_deadline  # NVML only when no replay file, for start-up speed

    return read_snapshot_with_deadline(cfg.health.timeout_s, hostname=node)


def kernel_source(cfg: Config, node: str | None) -> kernlog.Source:
    return kernlog.source_for(cfg.node_path(cfg.health.kernel_log, node))


def evaluate(cfg: Config, node: str, commit_cursor: bool) -> Report:
    """Run every check. With `commit_cursor` the XIDs read are marked judged (hooks, watch);
    without it (`check`) the kernel-log cursor is left where it was."""
    exp = expected(cfg, node)
    try:
        report = _evaluate(cfg, node, commit_cursor, exp.count)
    except NvmlTimeout:
        report = timeout_report(cfg.health.timeout_s, exp.count)
    report.expected_source = exp.source or None
    if exp.count is None:  # never silently off: said in check, --json and the decision log
        report.findings.append(count_unknown_finding(exp.tried))
    return report


def _evaluate(cfg: Config, node: str, commit_cursor: bool, expected: int | None) -> Report:
    snap = read_snapshot(cfg, node)
    xids: list[tuple[int | None, int, str]] = []
    limits = Limits.from_health(cfg.health)
    if cfg.health.kernel_log_enabled:
        source = kernel_source(cfg, node)
        state = cfg.state_path(node)
        try:
            new = kernlog.read_new(source, state, commit=commit_cursor, lock_timeout=cfg.health.timeout_s)
        except kernlog.KernlogError as exc:
            # The state dir is full or read-only, or the lock is held: a hook must still give a
            # verdict. Judge the log since the saved cursor without moving it (the XIDs are judged
            # again next time, never lost); if the log cannot be read at all, a GPU state that is
            # unhealthy on its own is still the verdict.
            new = _peek(source, state) if commit_cursor else None
            if new is None:
                report = run_checks(snap, expected, limits, [])
                if report.healthy:
                    raise
                print(f"slurmagent: {exc}; verdict from the GPU state alone", file=sys.stderr)
                return report
            print(f"slurmagent: {exc}; kernel-log cursor not saved (these XIDs will be judged again)",
                  file=sys.stderr)
        xids = [(gpu, k.xid, k.detail) for gpu, k in map_to_gpus(new, snap.gpus)]
    return run_checks(snap, expected, limits, xids)


def _peek(source: kernlog.Source, state) -> list[KernelXid] | None:
    try:
        return kernlog.read_new(source, state, commit=False)
    except kernlog.KernlogError:
        return None
