"""Gather a node's health: snapshot (replay file or NVML with a deadline) + kernel-log XIDs -> Report.

The healthy path imports no google library and makes no slurmctld call: the expected GPU
count comes from the local slurm.conf/gres.conf.
"""

from __future__ import annotations

import sys
from typing import Protocol

from ..gpu import kernlog
from ..core.checks import Limits, Report, run_checks, timeout_report
from ..state.config import Config
from ..errors import NvmlTimeout
from ..core.kernel_xid import KernelXid, map_to_gpus
from ..slurm.commands import expected_gpus_for, slurm_conf_path
from ..core.snapshot import NodeSnapshot, load


class SnapshotReader(Protocol):
    """Reads this node's GPUs under a hard deadline (nvml_deadline.ThreadSafeReader)."""

    def read(self, timeout_s: float, hostname: str | None = None) -> NodeSnapshot: ...


def expected_gpus(cfg: Config, node: str) -> int | None:
    if cfg.health.expected_gpus:
        return cfg.health.expected_gpus
    return expected_gpus_for(node, slurm_conf_path(cfg.slurm.conf))


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
    expected = expected_gpus(cfg, node)
    try:
        snap = read_snapshot(cfg, node)
    except NvmlTimeout:
        return timeout_report(cfg.health.timeout_s, expected)
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
