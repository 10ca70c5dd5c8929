"""Pure detectors beyond NVML's error state: what occupies the GPUs (leftover processes, orphaned
memory), the NVSwitch fabric and CUDA's start. Snapshot data in, findings out; the runtime
(`commands/health.py`) gathers who owns each pid and which jobs run, and acts on nothing here."""

from __future__ import annotations

from typing import Iterable, Mapping

from .checks import Finding, Severity
from .snapshot import CudaProbe, NodeSnapshot

LIBCUDA_MISSING = "libcuda-missing"  # prefix of CudaProbe.error when the library cannot be loaded
UVM_UNREACHABLE = "nvidia-uvm cannot be opened"  # in CudaProbe.error after a failed cuInit


def gpu_pids(snap: NodeSnapshot) -> set[int]:
    return {p.pid for g in snap.gpus for p in g.processes or ()}


def leftover_processes(snap: NodeSnapshot, owners: Mapping[int, str | None], running: set[str] | None,
                       allow: Iterable[str], job: str | None = None, epilog: bool = False) -> list[Finding]:
    """Compute processes that no running job of the node owns. `owners`: pid -> the job its cgroup or
    environment names (None: none); `running`: the node's running jobs (None: Slurm could not be asked);
    `job`: the hook's job (in the prolog it runs already; in the epilog it has ended: what it left behind
    is recorded, a warning). Allowlisted names (MPS, DCGM's host engine) never count."""
    allowed = set(allow)
    out: list[Finding] = []
    for g in snap.gpus:
        for p in g.processes or ():
            if p.name and p.name in allowed:
                continue
            owner = owners.get(p.pid)
            if owner is not None and owner != job and running is not None and owner in running:
                continue
            if owner is not None and owner == job and not epilog:
                continue
            who = ", ".join(x for x in (p.name, p.user) if x)
            held = f" holds {p.used_mib} MiB" if p.used_mib is not None else ""
            what = f"pid {p.pid}{f' ({who})' if who else ''}{held}"
            if epilog:
                left = f"job {job} left " if owner == job and job else ""
                out.append(Finding("gpu-leftover-processes", Severity.WARN, g.index,
                                   f"{left}{what} after the job ended", p.pid))
            elif owner is not None and running is None:
                out.append(Finding("gpu-leftover-processes", Severity.WARN, g.index,
                                   f"{what} of job {owner}: cannot tell whether it runs (Slurm not answering)", p.pid))
            else:
                of = f" of ended job {owner}" if owner is not None else ""
                out.append(Finding("gpu-leftover-processes", Severity.DRAIN, g.index,
                                   f"{what}{of}, no running job owns it", p.pid))
    return out


def orphaned_memory(snap: NodeSnapshot, threshold_mib: int) -> list[Finding]:
    """Used memory (v2 info: reserved memory apart) beyond the processes' shares by more than the
    threshold: memory no process holds. Judged only where every share is measured."""
    out: list[Finding] = []
    for g in snap.gpus:
        m = g.memory
        if g.lost or g.processes is None or m.used_mib is None or m.reserved_mib is None:
            continue
        if any(p.used_mib is None for p in g.processes):
            continue
        orphaned = m.used_mib - sum(p.used_mib or 0 for p in g.processes)
        if orphaned > threshold_mib:
            whose = f"beyond what its {len(g.processes)} process(es) hold" if g.processes else "with no process"
            out.append(Finding("gpu-orphaned-memory", Severity.DRAIN, g.index,
                               f"{orphaned} MiB used {whose} (over {threshold_mib} MiB)", orphaned))
    return out


def fabric(snap: NodeSnapshot) -> list[Finding]:
    """An NVSwitch fabric that is not completed, or completed with an error: CUDA then fails with
    "system not yet initialized" while NVML answers. No fabric: nothing."""
    out: list[Finding] = []
    for g in snap.gpus:
        f = g.fabric
        if f is None or f.state is None:
            continue
        if f.state != "completed":
            out.append(Finding("nvswitch-fabric", Severity.DRAIN, g.index,
                               f"NVSwitch fabric not initialised (state {f.state})", f.state))
        elif f.status not in (None, "NVML_SUCCESS"):
            out.append(Finding("nvswitch-fabric", Severity.DRAIN, g.index,
                               f"NVSwitch fabric failed ({f.status})", f.status))
    return out


def cuda(probe: CudaProbe | None, nvml_gpus: int, sandboxed: bool = False) -> list[Finding]:
    """cuInit failing, or seeing fewer devices than NVML: the GPUs answer NVML but cannot run CUDA.
    `sandboxed` (the resume unit: its device list is fixed at start, it cannot load nvidia-uvm):
    CUDA_ERROR_UNKNOWN with nvidia-uvm unreachable is the sandbox's, a warning; the first prolog
    of the boot, outside any sandbox, loads the module and judges CUDA (`cuda_first_prolog`)."""
    if probe is None:
        return []
    if probe.error and probe.error.startswith(LIBCUDA_MISSING):
        return [Finding("cuda-init", Severity.WARN, None, f"not checked: {probe.error}", probe.error)]
    if probe.error and sandboxed and probe.error.startswith("CUDA_ERROR_UNKNOWN") and UVM_UNREACHABLE in probe.error:
        return [Finding("cuda-init", Severity.WARN, None, f"not checked in this unit's sandbox: {probe.error}; "
                        "the first prolog checks CUDA", probe.error)]
    if probe.error:
        return [Finding("cuda-init", Severity.DRAIN, None, f"CUDA cannot start ({probe.error})", probe.error)]
    if probe.devices is not None and probe.devices < nvml_gpus:
        return [Finding("cuda-init", Severity.DRAIN, None,
                        f"CUDA sees {probe.devices} of the {nvml_gpus} GPUs NVML sees", probe.devices)]
    return []
