"""Gather a node's health: snapshot (replay file or NVML with a deadline) + kernel-log XIDs -> Report.

The healthy path imports no google library and makes no slurmctld or network call. The
expected GPU count (`expected`), first answer wins: `[health] expected_gpus`; the node's gpu
gres in slurm.conf/gres.conf at `[slurm] conf`, $SLURM_CONF, the configless cache
(`slurm.commands.CONF_SEARCH`), /etc/slurm; else the larger of the machine type's GPUs (from
the per-boot cache `expiry-watch` writes) and the NVIDIA GPUs on the PCI bus. None of them: a
`gpu-count-unknown` warning that names what was tried, never silence.

Then the node's own checks (`node_findings`: GPU NICs, local mounts, full filesystems, DCGM
diagnostics), each where its catalogue spec says (`layer`) unless `[checks]` switches it. They
read this machine, so a replay snapshot (`[health] snapshot`: a simulated node, e.g. one of the
local cluster's) runs them only over sources a caller gives (`NodeSources`: the tests' fakes).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Protocol

from ..gpu import kernlog
from ..core import catalogue, gpu_occupancy as occ
from ..core.catalogue import RULE_CHECK
from ..core.checks import Finding, Limits, Report, Severity, count_unknown_finding, run_checks, timeout_report
from ..core.node_catalogue import DCGM_DIAG, FILESYSTEM_FULL, GPU_NICS, LOCAL_MOUNTS
from ..core.snapshot import CudaProbe
from ..state.config import Config
from ..errors import NvmlTimeout, SlurmagentError
from ..core.kernel_xid import KernelXid, map_to_gpus
from ..slurm.commands import CONF_SEARCH, Slurm, conf_candidates, gres_gpu_count
from ..slurm.job_processes import job_of_pid
from ..state.fsutil import UntrustedFile, atomic_write_text, read_state_file
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
# slurmd kills a HealthCheckProgram at 60 s: DCGM gets what is left of 45 s after the other
# checks (at most 40 s, none under 5 s), the drain and the decision log the rest.
HEALTHCHECK_BUDGET_S = 45.0
HEALTHCHECK_DCGM_MAX_S = 40.0
DCGM_MIN_S = 5.0


@dataclass(frozen=True)
class NodeSources:
    """Where the node checks read this machine: data, so tests point them at a fake tree."""
    sysfs: Path = Path("/sys")
    proc: Path = Path("/proc")
    boot_id_path: str = BOOT_ID_PATH
    jobs_on_node: Callable[[Config, str], list[str]] | None = None  # None: squeue (`Slurm.jobs_on_node`)
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs  # how full a filesystem is


def _jobs_on_node(cfg: Config, node: str) -> list[str]:
    return Slurm.from_config(cfg).jobs_on_node(node, ("RUNNING", "SUSPENDED", "COMPLETING"))


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


@dataclass(frozen=True)
class Seams:
    """What the checks beyond NVML's state ask outside the snapshot (tests pass fakes)."""
    owner_of: Callable[[int], str | None] = job_of_pid
    running: Callable[[Config, str], set[str]] = lambda cfg, node: set(Slurm.from_config(cfg).jobs_on_node(node))
    cuda: Callable[[float], CudaProbe] | None = None  # None: libcuda in a forked child (gpu/cuda.py)
    sleep: Callable[[float], None] = time.sleep
    boot: Callable[[], str] = boot_id  # this boot's id: CUDA is judged once per boot outside a sandbox


def evaluate(cfg: Config, node: str, commit_cursor: bool, layer: str | None = None, job: str | None = None,
             seams: Seams = Seams(), node_sources: NodeSources | None = None) -> Report:
    """Run every check of `layer` (None: `slurmagent check`, every enabled check) that `[checks]`
    leaves on. With `commit_cursor` the XIDs read are marked judged (hooks, watch); without it
    (`check`) the kernel-log cursor is left where it was. `job`: the hook's job."""
    started = time.monotonic()
    exp = expected(cfg, node)
    beyond: list[Finding] = []
    try:
        snap = read_snapshot(cfg, node)
        report = _evaluate(cfg, node, commit_cursor, exp.count, snap)
        beyond = beyond_nvml(cfg, node, snap, layer, job, seams)
    except NvmlTimeout:
        report = timeout_report(cfg.health.timeout_s, exp.count)
    report.findings = _in_layer(cfg, report.findings, layer) + beyond  # beyond_nvml asks the catalogue itself
    if node_sources is not None or not cfg.health.snapshot:
        report.findings.extend(node_findings(cfg, node, layer or "check", node_sources or NodeSources(), started))
    report.expected_source = exp.source or None
    if exp.count is None:  # never silently off: said in check, --json and the decision log
        report.findings.extend(_in_layer(cfg, [count_unknown_finding(exp.tried)], layer))
    return report


def _in_layer(cfg: Config, findings: list[Finding], layer: str | None) -> list[Finding]:
    """NVML's findings (every rule is read at once) of the checks that run in `layer`."""
    return [f for f in findings if f.rule not in RULE_CHECK or _runs(cfg, RULE_CHECK[f.rule], layer)]


def evaluator(layer: str, node_sources: NodeSources | None = None, job: str | None = None):
    """`evaluate` for one layer (and the hook's job), in the hooks' (cfg, node, commit_cursor) signature."""
    def run(cfg: Config, node: str, commit_cursor: bool) -> Report:
        return evaluate(cfg, node, commit_cursor, layer, job, node_sources=node_sources)
    return run


def node_findings(cfg: Config, node: str, layer: str, src: NodeSources, started: float | None = None) -> list[Finding]:
    """The node checks that run in `layer` and are switched on. "Not available" (off Google
    Cloud, no DCGM) is a warning said once per boot (always in `check`), never a failure."""
    h, on, off = cfg.health, cfg.checks.on, cfg.checks.off
    started = time.monotonic() if started is None else started
    state, boot = cfg.state_path(node), boot_id(src.boot_id_path)
    out: list[Finding] = []

    def runs(name: str) -> bool:
        return catalogue.runs(name, None if layer == "check" else layer, on, off)

    if runs(GPU_NICS):
        from ..core import node_checks as nc  # the node checks' code only where they run: start-up speed
        from ..gcp import nics  # the metadata client (urllib) only where this check runs: start-up speed

        attached, note = nics.attached_nics(nics.cache_file(state), boot)
        if attached is None:
            if note or layer == "check":
                out.append(nc.not_available(GPU_NICS, note or "no NIC list from the metadata server this boot"))
        else:
            out.extend(nc.nic_findings(attached, nics.guest_links(src.sysfs)))
    mounts_on, full_on = runs(LOCAL_MOUNTS), runs(FILESYSTEM_FULL)
    if (mounts_on or full_on) and (h.mounts or h.ckpt_filesystem):
        from ..core import node_checks as nc  # only with mounts configured: start-up speed of the healthy prolog
        from ..state import mounts  # only with mounts configured: start-up speed of the healthy prolog

        table = mounts.read_mounts(src.proc)
        if table is None:  # our own failure, not the disk's: said, never a drain
            out.append(nc.not_available(LOCAL_MOUNTS, f"cannot read {src.proc}/self/mountinfo"))
            table, mounts_on = {}, False
        for point in h.mounts:
            mount = table.get(point)
            probe, used = mounts.probe(point, h.timeout_s, src.statvfs) if mount is not None and mounts_on else (None, None)
            if mounts_on:
                out.extend(nc.mount_findings(point, mount, probe, idle=layer == "resume"))
            if full_on and mount is not None and not (probe and probe.timed_out):  # hung: not asked twice
                used = used if used is not None else mounts.used_percent(point, h.timeout_s, src.statvfs)
                out.extend(nc.full_findings(point, used, h.full_warn_percent))
        if full_on and h.ckpt_filesystem and h.ckpt_filesystem not in h.mounts:
            out.extend(nc.full_findings(h.ckpt_filesystem, mounts.used_percent(h.ckpt_filesystem, h.timeout_s, src.statvfs),
                                        h.full_warn_percent))
    level = h.dcgm_resume_level if layer == "resume" else h.dcgm_healthcheck_level
    if layer in ("healthcheck", "check", "resume") and level and catalogue.enabled(DCGM_DIAG, on, off):
        out.extend(_dcgm_unless_busy(cfg, node, layer, level, src, state, boot, started))
    return out


def _dcgm_unless_busy(cfg: Config, node: str, layer: str, level: int, src: NodeSources, state: Path,
                      boot: str, started: float) -> list[Finding]:
    """`dcgmi diag` where DCGM is installed and no job is on the node (squeue asked only then)."""
    from ..gpu.dcgm import installed  # only where DCGM runs in this layer: start-up speed

    if installed(cfg.health.dcgmi):
        try:
            jobs = (src.jobs_on_node or _jobs_on_node)(cfg, node)
        except SlurmagentError as exc:
            jobs = [f"unknown ({exc})"]
        if jobs:  # DCGM's diagnostics load the GPUs: never under a job
            return [Finding(DCGM_DIAG, Severity.WARN, None, f"not run: jobs on the node ({', '.join(jobs)})",
                            None)] if layer == "check" else []
    timeout = cfg.health.dcgm_timeout_s
    if layer != "resume":
        timeout = min(timeout, HEALTHCHECK_DCGM_MAX_S, started + HEALTHCHECK_BUDGET_S - time.monotonic())
        if timeout < DCGM_MIN_S:
            return [Finding(DCGM_DIAG, Severity.WARN, None, "not run: the other checks took the health check's "
                            f"time (slurmd kills it at 60 s; {timeout:.0f} s left)", None)]
    return _dcgm(cfg, layer, level, state, boot, timeout)


def _dcgm(cfg: Config, layer: str, level: int, state: Path, boot: str, timeout: float) -> list[Finding]:
    from ..core import node_checks as nc  # only where DCGM runs in this layer: start-up speed
    from ..gpu.dcgm import run_diag  # only where DCGM runs in this layer: start-up speed

    run = run_diag(cfg.health.dcgmi, level, timeout)
    if run.unavailable:
        return [nc.not_available(DCGM_DIAG, run.unavailable)] if _first_this_boot(state, boot, "dcgm") or layer == "check" else []
    if run.error or run.result is None:
        return [Finding(DCGM_DIAG, Severity.WARN, None, run.error or "no result", None)]
    return nc.diag_findings(level, run.result)


def _first_this_boot(state: Path, boot: str, what: str) -> bool:
    """True the first time this boot (a mark `<state_dir>/said-<what>` holds the boot id)."""
    mark = state / f"said-{what}"
    if _marked(mark, boot):
        return False
    _mark(mark, boot)
    return True


def _marked(mark: Path, boot: str) -> bool:
    """Whether the mark file holds this boot's id (as root, only a file root wrote)."""
    try:
        return read_state_file(mark).decode().strip() == boot
    except (UntrustedFile, OSError, UnicodeDecodeError):
        return False


def _mark(mark: Path, boot: str) -> None:
    """Write this boot's id ("" when unknown: then "said once" still holds until it is known)."""
    try:
        atomic_write_text(mark, boot + "\n", 0o644, durable=False)
    except OSError:
        pass


CUDA_JUDGED = "cuda-judged"  # <state_dir>/cuda-judged: the boot id whose CUDA a check found working


def _runs(cfg: Config, check: str, layer: str | None) -> bool:
    """The catalogue's answer, and `cuda-init` in every prolog where `[health] cuda_in_prolog` asks for it."""
    on, off = cfg.checks.on, cfg.checks.off
    if check == "cuda-init" and layer == "prolog" and cfg.health.cuda_in_prolog:
        return catalogue.enabled(check, on, off)
    return catalogue.runs(check, layer, on, off)


def beyond_nvml(cfg: Config, node: str, snap: NodeSnapshot | None, layer: str | None, job: str | None,
                seams: Seams = Seams()) -> list[Finding]:
    """Leftover processes, orphaned memory, the NVSwitch fabric, CUDA's start. What a GPU process
    belongs to is asked only when there is one (nothing costs more on a clean node)."""
    if snap is None or snap.nvml_error:
        return []
    on, off = cfg.checks.on, cfg.checks.off

    def occupancy(snap: NodeSnapshot) -> list[Finding]:
        found: list[Finding] = []
        if catalogue.runs("gpu-orphaned-memory", layer, on, off):
            found += occ.orphaned_memory(snap, cfg.health.orphaned_memory_mib)
        pids = occ.gpu_pids(snap)
        if pids and catalogue.runs("gpu-leftover-processes", layer, on, off):
            owners = {pid: seams.owner_of(pid) for pid in pids}
            running: set[str] | None = set()
            if any(owner is not None and owner != job for owner in owners.values()):
                try:
                    running = seams.running(cfg, node)
                except SlurmagentError:
                    running = None
            found += occ.leftover_processes(snap, owners, running, cfg.health.gpu_process_allowlist, job,
                                            epilog=layer == "epilog")
        return found

    out = occupancy(snap)
    if layer is not None and cfg.health.leftover_grace_s > 0 and any(f.severity is Severity.DRAIN for f in out):
        seams.sleep(cfg.health.leftover_grace_s)  # the previous job's CUDA teardown: judge a second reading
        out = occupancy(read_snapshot(cfg, node))
    if catalogue.runs("nvswitch-fabric", layer, on, off):
        out += occ.fabric(snap)
    state, boot = cfg.state_path(node), ""
    if layer == "prolog" and cfg.health.cuda_first_prolog and catalogue.enabled("cuda-init", on, off):
        boot = seams.boot()  # the first prolog of a boot judges CUDA unless something did already
    if _runs(cfg, "cuda-init", layer) or (boot and not _marked(state / CUDA_JUDGED, boot)):
        if cfg.health.snapshot:  # a replay judges what the file says, never this machine's CUDA
            probe = snap.cuda
        elif seams.cuda is not None:
            probe = seams.cuda(cfg.health.cuda_timeout_s)
        else:
            from ..gpu.cuda import probe_with_deadline  # only where the check runs: start-up speed

            probe = probe_with_deadline(cfg.health.cuda_timeout_s)
        found = occ.cuda(probe, len(snap.gpus), sandboxed=layer == "resume")
        if probe is not None and layer is not None and (not found or (probe.error or "").startswith(occ.LIBCUDA_MISSING)):
            _mark(state / CUDA_JUDGED, boot or seams.boot())
        out += found
    return out




def capture_snapshot(cfg: Config, node: str, read: Callable[..., NodeSnapshot] | None = None,
                     cuda: Callable[[float], CudaProbe] | None = None) -> NodeSnapshot:
    """`slurmagent snapshot`: NVML's answers and, unless `[checks] off` names cuda-init, what
    cuInit answers (a replay judges CUDA from the file, never the replaying machine's)."""
    if read is None:
        from ..gpu.nvml_deadline import read_snapshot_with_deadline as read  # start-up speed
    snap = read(cfg.health.timeout_s, hostname=node)
    if snap.nvml_error is None and catalogue.runs("cuda-init", None, cfg.checks.on, cfg.checks.off):
        if cuda is None:
            from ..gpu.cuda import probe_with_deadline as cuda  # start-up speed
        snap.cuda = cuda(cfg.health.cuda_timeout_s)
    return snap


def _evaluate(cfg: Config, node: str, commit_cursor: bool, expected: int | None, snap: NodeSnapshot) -> Report:
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
