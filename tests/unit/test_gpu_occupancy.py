"""Issue 39's GPU checks: leftover processes, orphaned memory, the NVSwitch fabric, CUDA's start
(pure detectors, the runtime's seams, the NVML reads against a fake pynvml, libcuda through a fake)."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from support import healthy_snapshot_dict, write_json
from support.fakes.slurm import FakeSlurm
from slurmagent.commands.health import Seams, beyond_nvml, evaluate
from slurmagent.commands.hooks import HookContext, run_hook
from slurmagent.core import gpu_occupancy as occ
from slurmagent.core.checks import Severity
from slurmagent.core.snapshot import CudaProbe, NodeSnapshot, load
from slurmagent.errors import SlurmagentError
from slurmagent.gpu import cuda, nvml as reader
from slurmagent.slurm.commands import Slurm
from slurmagent.slurm.job_processes import job_of_pid
from slurmagent.state.decisionlog import read_records
from slurmagent.state.config import parse
from test_nvml import FakeNvml, h100_node

MIB = 1 << 20


def snap_with(**per_gpu: dict) -> dict:
    """A healthy 8-GPU snapshot; `g2={...}` merges keys into GPU 2."""
    d = healthy_snapshot_dict(8)
    for key, extra in per_gpu.items():
        d["gpus"][int(key[1:])].update(extra)
    return d


def config(tmp_path: Path, data: dict, **health) -> object:
    path = write_json(tmp_path / "snap.json", data)
    return parse({"state_dir": str(tmp_path / "state"),
                  "health": {"snapshot": str(path), "expected_gpus": 8, "kernel_log_enabled": False,
                             "leftover_grace_s": 0, **health}}, "test")


class Recorder:
    """Seams that record what the runtime asked."""

    def __init__(self, owners: dict[int, str | None] | None = None, running: set[str] | Exception = frozenset(),
                 probe: CudaProbe | None = None):
        self.owners = owners or {}
        self.running_answer = running
        self.asked_slurm = 0
        self.asked_owner: list[int] = []
        self.slept: list[float] = []
        self.probe = probe
        self.probes = 0

    def seams(self) -> Seams:
        def owner(pid: int) -> str | None:
            self.asked_owner.append(pid)
            return self.owners.get(pid)

        def running(_cfg, _node) -> set[str]:
            self.asked_slurm += 1
            if isinstance(self.running_answer, Exception):
                raise self.running_answer
            return set(self.running_answer)

        def probe(_timeout: float) -> CudaProbe:
            self.probes += 1
            return self.probe or CudaProbe(devices=8)

        return Seams(owner_of=owner, running=running, cuda=probe, sleep=self.slept.append)


LEFTOVER = {"processes": [{"pid": 4242, "used_mib": 4000, "name": "python", "user": "alice"}],
            "memory": {"total_mib": 81559, "used_mib": 4001, "reserved_mib": 544}}


# --- leftover processes ----------------------------------------------------------------------


def test_clean_gpus_ask_nothing_and_are_healthy(tmp_path) -> None:
    rec = Recorder()
    clean = {"processes": [], "memory": {"total_mib": 81559, "used_mib": 1, "reserved_mib": 544}}
    report = evaluate(config(tmp_path, snap_with(g2=clean)), "n1", False, layer="prolog", job="7", seams=rec.seams())
    assert report.healthy and report.findings == []
    assert rec.asked_owner == [] and rec.asked_slurm == 0 and rec.slept == []


def test_a_process_of_no_job_drains_naming_gpu_pid_user_and_mib(tmp_path) -> None:
    rec = Recorder(owners={4242: None})
    report = evaluate(config(tmp_path, snap_with(g2=LEFTOVER)), "n1", False, layer="prolog", job="7",
                      seams=rec.seams())
    assert not report.healthy
    assert report.worst.rule == "gpu-leftover-processes" and report.worst.gpu == 2
    assert report.worst.summary == ("gpu-leftover-processes: gpu 2 pid 4242 (python, alice) holds 4000 MiB, "
                                    "no running job owns it")
    assert rec.asked_slurm == 0  # a process of no job needs no Slurm answer


def test_the_new_jobs_own_process_is_fine_without_asking_slurm(tmp_path) -> None:
    rec = Recorder(owners={4242: "7"})
    report = evaluate(config(tmp_path, snap_with(g2=LEFTOVER)), "n1", False, layer="prolog", job="7", seams=rec.seams())
    assert report.healthy and rec.asked_slurm == 0


def test_another_running_job_owns_it_on_a_shared_node(tmp_path) -> None:
    rec = Recorder(owners={4242: "5"}, running={"5", "7"})
    report = evaluate(config(tmp_path, snap_with(g2=LEFTOVER)), "n1", False, layer="prolog", job="7", seams=rec.seams())
    assert report.healthy and rec.asked_slurm == 1


def test_a_process_of_an_ended_job_drains(tmp_path) -> None:
    rec = Recorder(owners={4242: "5"}, running={"7"})
    report = evaluate(config(tmp_path, snap_with(g2=LEFTOVER)), "n1", False, layer="healthcheck", seams=rec.seams())
    assert not report.healthy and "of ended job 5" in report.worst.detail


def test_slurm_not_answering_only_warns_for_another_jobs_process(tmp_path) -> None:
    rec = Recorder(owners={4242: "5"}, running=SlurmagentError("squeue timed out"))
    report = evaluate(config(tmp_path, snap_with(g2=LEFTOVER)), "n1", False, layer="prolog", job="7", seams=rec.seams())
    assert report.healthy
    assert [f.rule for f in report.findings] == ["gpu-leftover-processes"]
    assert report.findings[0].severity is Severity.WARN


def test_allowlisted_daemons_never_count(tmp_path) -> None:
    mps = {"processes": [{"pid": 99, "used_mib": 30, "name": "nvidia-cuda-mps-server"},
                         {"pid": 98, "used_mib": 10, "name": "my-daemon"}]}
    cfg = config(tmp_path, snap_with(g0=mps), gpu_process_allowlist=["nvidia-cuda-mps-server", "my-daemon"])
    assert evaluate(cfg, "n1", False, layer="prolog", job="7", seams=Recorder().seams()).healthy
    cfg = config(tmp_path, snap_with(g0=mps))  # the defaults know MPS, not my-daemon
    report = evaluate(cfg, "n1", False, layer="prolog", job="7", seams=Recorder().seams())
    assert [f.observed for f in report.findings] == [98]


def test_the_grace_reads_again_and_a_process_gone_by_then_passes(tmp_path) -> None:
    data = snap_with(g2=LEFTOVER)
    cfg = config(tmp_path, data, leftover_grace_s=3)
    rec = Recorder(owners={4242: "5"}, running=set())
    seams = rec.seams()

    def teardown_finishes(seconds: float) -> None:  # the previous job's teardown ends during the grace
        rec.slept.append(seconds)
        write_json(tmp_path / "snap.json", healthy_snapshot_dict(8))

    seams = Seams(owner_of=seams.owner_of, running=seams.running, cuda=seams.cuda, sleep=teardown_finishes)
    assert evaluate(cfg, "n1", False, layer="prolog", job="7", seams=seams).healthy
    assert rec.slept == [3]
    write_json(tmp_path / "snap.json", data)  # still there after the grace: drained
    report = evaluate(cfg, "n1", False, layer="prolog", job="7", seams=rec.seams())
    assert not report.healthy and rec.slept == [3, 3]


def test_the_epilog_records_what_its_job_left_and_drains_nothing(tmp_path) -> None:
    rec = Recorder(owners={4242: "7"}, running=set())
    report = evaluate(config(tmp_path, snap_with(g2=LEFTOVER)), "n1", False, layer="epilog", job="7", seams=rec.seams())
    assert report.healthy
    assert [f.summary for f in report.findings] == [
        "gpu-leftover-processes: gpu 2 job 7 left pid 4242 (python, alice) holds 4000 MiB after the job ended"]


def test_kill_switch_turns_the_check_off(tmp_path) -> None:
    path = write_json(tmp_path / "snap.json", snap_with(g2=LEFTOVER))
    cfg = parse({"health": {"snapshot": str(path), "expected_gpus": 8, "kernel_log_enabled": False,
                            "leftover_grace_s": 0},
                 "checks": {"off": ["gpu-leftover-processes"]}}, "test")
    rec = Recorder(owners={4242: None})
    assert evaluate(cfg, "n1", False, layer="prolog", job="7", seams=rec.seams()).healthy
    assert rec.asked_owner == []


def test_job_of_pid_reads_the_cgroup_then_the_environment(tmp_path) -> None:
    proc = tmp_path / "proc"
    for pid, cgroup, environ in ((10, b"0::/system.slice/slurmstepd.scope/job_123/step_0/user/task_0\n", b""),
                                 (11, b"0::/user.slice\n", b"HOME=/root\0SLURM_JOB_ID=456\0"),
                                 (12, b"0::/user.slice\n", b"HOME=/root\0")):
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "stat").write_bytes(f"{pid} (python) S 1 {pid} {pid} 0".encode())
        (d / "cgroup").write_bytes(cgroup)
        (d / "environ").write_bytes(environ)
    assert [job_of_pid(p, str(proc)) for p in (10, 11, 12, 13)] == ["123", "456", None, None]


# --- orphaned memory --------------------------------------------------------------------------


def test_orphaned_memory_with_no_process_drains(tmp_path) -> None:
    orphan = {"processes": [], "memory": {"total_mib": 81559, "used_mib": 30000, "reserved_mib": 544}}
    report = evaluate(config(tmp_path, snap_with(g5=orphan)), "n1", False, layer="prolog", job="7",
                      seams=Recorder().seams())
    assert report.worst.rule == "gpu-orphaned-memory" and report.worst.gpu == 5
    assert report.worst.observed == 30000 and "with no process" in report.worst.detail


def test_memory_the_processes_hold_or_under_the_threshold_is_fine() -> None:
    snap = NodeSnapshot.from_dict(snap_with(g2=LEFTOVER, g3={"processes": [], "memory": {"used_mib": 900, "reserved_mib": 544}}))
    assert occ.orphaned_memory(snap, 1024) == []
    assert [f.gpu for f in occ.orphaned_memory(snap, 800)] == [3]


def test_orphaned_memory_is_not_judged_without_reserved_or_a_share() -> None:
    v1 = {"processes": [], "memory": {"total_mib": 81559, "used_mib": 30000}}
    unknown_share = {"processes": [{"pid": 1}], "memory": {"used_mib": 30000, "reserved_mib": 544}}
    snap = NodeSnapshot.from_dict(snap_with(g0=v1, g1=unknown_share))
    assert occ.orphaned_memory(snap, 1024) == []


# --- NVSwitch fabric --------------------------------------------------------------------------


@pytest.mark.parametrize("fabric, bad", [
    ({"state": "completed", "status": "NVML_SUCCESS"}, False),
    ({"state": "in_progress"}, True),
    ({"state": "not_started"}, True),
    ({"state": "completed", "status": "NVML_ERROR_UNKNOWN"}, True),
])
def test_fabric_states(tmp_path, fabric: dict, bad: bool) -> None:
    report = evaluate(config(tmp_path, snap_with(g1={"fabric": fabric})), "n1", False, layer="prolog", job="7",
                      seams=Recorder().seams())
    assert report.healthy is not bad
    if bad:
        assert report.worst.rule == "nvswitch-fabric" and report.worst.gpu == 1


def test_no_fabric_reports_nothing_and_old_snapshots_still_read(tmp_path) -> None:
    report = evaluate(config(tmp_path, healthy_snapshot_dict(8)), "n1", False, layer="healthcheck",
                      seams=Recorder().seams())
    assert report.healthy and report.findings == []


# --- CUDA --------------------------------------------------------------------------------------


def test_cuda_runs_in_healthcheck_and_in_a_prolog_only_first_in_a_boot_or_when_configured(tmp_path) -> None:
    data = healthy_snapshot_dict(8)
    data["cuda"] = {"error": "CUDA_ERROR_SYSTEM_NOT_READY"}
    cfg = config(tmp_path, data, cuda_first_prolog=False)
    assert evaluate(cfg, "n1", False, layer="prolog", job="7", seams=Recorder().seams()).healthy
    report = evaluate(cfg, "n1", False, layer="healthcheck", seams=Recorder().seams())
    assert report.worst.summary == "cuda-init: CUDA cannot start (CUDA_ERROR_SYSTEM_NOT_READY)"
    cfg = config(tmp_path, data, cuda_first_prolog=False, cuda_in_prolog=True)
    assert not evaluate(cfg, "n1", False, layer="prolog", job="7", seams=Recorder().seams()).healthy
    first = evaluate(config(tmp_path, data), "n1", False, layer="prolog", job="7", seams=Recorder().seams())
    assert first.worst.summary == "cuda-init: CUDA cannot start (CUDA_ERROR_SYSTEM_NOT_READY)"  # the boot's first


def test_live_probe_sees_fewer_devices_than_nvml(tmp_path) -> None:
    cfg = config(tmp_path, healthy_snapshot_dict(8))
    cfg = type(cfg)(**{**vars(cfg), "health": type(cfg.health)(**{**vars(cfg.health), "snapshot": ""})})
    rec = Recorder(probe=CudaProbe(devices=7))
    snap = NodeSnapshot.from_dict(healthy_snapshot_dict(8))
    found = beyond_nvml(cfg, "n1", snap, "resume", None, rec.seams())
    assert [f.detail for f in found] == ["CUDA sees 7 of the 8 GPUs NVML sees"] and rec.probes == 1
    rec = Recorder(probe=CudaProbe(devices=8))
    assert beyond_nvml(cfg, "n1", snap, "resume", None, rec.seams()) == [] and rec.probes == 1


def test_a_cuinit_failure_without_nvidia_uvm_drains_except_inside_the_resume_units_sandbox(tmp_path) -> None:
    """After a boot nvidia-uvm is loaded by the first CUDA user; the resume unit's device list was
    made before that and it may not load modules: there, cuInit failing with /dev/nvidia-uvm
    unreachable is the sandbox's (a warning; the node is judged by the other checks and the next
    healthcheck). Outside it (healthcheck runs as slurmd's root), the same failure drains."""
    probe = cuda.probe(lambda: FakeLibcuda(init=999), str(tmp_path / "nvidia-uvm"))
    assert probe.error == f"CUDA_ERROR_UNKNOWN; {occ.UVM_UNREACHABLE} ({tmp_path}/nvidia-uvm: No such file or directory)"
    cfg = config(tmp_path, healthy_snapshot_dict(8))
    cfg = type(cfg)(**{**vars(cfg), "health": type(cfg.health)(**{**vars(cfg.health), "snapshot": ""})})
    snap = NodeSnapshot.from_dict(healthy_snapshot_dict(8))
    resume = beyond_nvml(cfg, "n1", snap, "resume", None, Recorder(probe=probe).seams())
    assert [(f.severity, f.detail) for f in resume] == [
        (Severity.WARN, f"not checked in this unit's sandbox: {probe.error}; the first prolog checks CUDA")]
    healthcheck = beyond_nvml(cfg, "n1", snap, "healthcheck", None, Recorder(probe=probe).seams())
    assert [(f.severity, f.detail) for f in healthcheck] == [(Severity.DRAIN, f"CUDA cannot start ({probe.error})")]
    for code in (802, 100):  # not what a missing nvidia-uvm answers: the GPUs', wherever it is asked
        sealed = cuda.probe(lambda: FakeLibcuda(init=code), str(tmp_path / "nvidia-uvm"))
        assert occ.cuda(sealed, 8, sandboxed=True)[0].severity is Severity.DRAIN, sealed


def test_the_first_prolog_of_a_boot_judges_cuda_unless_a_check_found_it_working(tmp_path) -> None:
    """After a boot the resume unit may only warn (its sandbox cannot load nvidia-uvm): the first
    job's prolog, slurmd's root, runs cuda-init; once a check found CUDA working this boot, the
    prologs do not pay for it again; a new boot asks again."""
    cfg = config(tmp_path, healthy_snapshot_dict(8))
    cfg = type(cfg)(**{**vars(cfg), "health": type(cfg.health)(**{**vars(cfg.health), "snapshot": ""})})
    snap = NodeSnapshot.from_dict(healthy_snapshot_dict(8))
    boot = ["boot-1"]

    def prolog(probe: CudaProbe, layer: str = "prolog") -> tuple[list, int]:
        rec = Recorder(probe=probe)
        seams = dataclasses.replace(rec.seams(), boot=lambda: boot[0])
        return [(f.severity, f.detail) for f in beyond_nvml(cfg, "n1", snap, layer, "7", seams)], rec.probes

    sandboxed = CudaProbe(error=f"CUDA_ERROR_UNKNOWN; {occ.UVM_UNREACHABLE} (/dev/nvidia-uvm: No such file or directory)")
    assert prolog(sandboxed, "resume") == ([(Severity.WARN, f"not checked in this unit's sandbox: {sandboxed.error}; "
                                                            "the first prolog checks CUDA")], 1)
    assert prolog(CudaProbe(devices=7)) == ([(Severity.DRAIN, "CUDA sees 7 of the 8 GPUs NVML sees")], 1)
    assert prolog(CudaProbe(devices=8)) == ([], 1)  # found working: marked for this boot
    assert prolog(CudaProbe(devices=7)) == ([], 0)  # not asked again this boot
    boot[0] = "boot-2"
    assert prolog(CudaProbe(devices=8), "resume") == ([], 1)  # the resume unit could judge it this time
    assert prolog(CudaProbe(devices=7)) == ([], 0)
    boot[0] = "boot-3"
    off = type(cfg)(**{**vars(cfg), "health": type(cfg.health)(**{**vars(cfg.health), "cuda_first_prolog": False})})
    rec = Recorder(probe=CudaProbe(devices=7))
    assert beyond_nvml(off, "n1", snap, "prolog", "7", dataclasses.replace(rec.seams(), boot=lambda: "boot-3")) == []
    assert rec.probes == 0


def test_no_libcuda_only_warns() -> None:
    found = occ.cuda(CudaProbe(error=f"{occ.LIBCUDA_MISSING}: libcuda.so.1: cannot open"), 8)
    assert [f.severity for f in found] == [Severity.WARN]


class FakeLibcuda:
    """cuInit / cuDeviceGetCount / cuGetErrorName as libcuda answers them (ctypes by reference)."""

    def __init__(self, init: int = 0, devices: int = 8, hang_s: float = 0.0):
        self.init, self.devices, self.hang_s = init, devices, hang_s

    def cuInit(self, flags: int) -> int:
        assert flags == 0
        time.sleep(self.hang_s)
        return self.init

    def cuDeviceGetCount(self, ref) -> int:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # as libcuda: a job's view hides the others
        ref._obj.value = self.devices if visible is None else len(visible.split(","))
        return 0

    def cuGetErrorName(self, code: int, ref) -> int:
        if code != 802:
            return 1  # CUDA_ERROR_INVALID_VALUE: the fallback table names it
        ref._obj.value = b"CUDA_ERROR_SYSTEM_NOT_READY"
        return 0


def test_probe_through_a_fake_libcuda() -> None:
    uvm = os.devnull  # opens: the failures below are CUDA's own
    assert cuda.probe(lambda: FakeLibcuda(), uvm) == CudaProbe(devices=8)
    assert cuda.probe(lambda: FakeLibcuda(init=802), uvm) == CudaProbe(error="CUDA_ERROR_SYSTEM_NOT_READY")
    assert cuda.probe(lambda: FakeLibcuda(init=100), uvm) == CudaProbe(error="CUDA_ERROR_NO_DEVICE")

    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    assert cuda.probe(missing).error.startswith(occ.LIBCUDA_MISSING)


def test_the_probe_counts_the_nodes_gpus_not_the_callers_view(monkeypatch) -> None:
    """`slurmagent snapshot` inside `srun --gpus=1`, or a prolog given the job's GPUs: the probe
    sees every GPU of the node, so a replay never drains on "fewer devices than NVML"."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert cuda.probe(lambda: FakeLibcuda()) == CudaProbe(devices=1)  # what the child must not see
    assert cuda.probe_with_deadline(5.0, lambda: FakeLibcuda()) == CudaProbe(devices=8)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the caller's own environment is left alone


def test_probe_with_deadline_answers_and_a_hang_is_a_timeout() -> None:
    assert cuda.probe_with_deadline(5.0, lambda: FakeLibcuda(devices=4)) == CudaProbe(devices=4)
    with pytest.raises(RuntimeError, match="cuda probe raised ZeroDivisionError"):  # a bug is no CUDA verdict
        cuda.probe_with_deadline(5.0, lambda: 1 / 0)
    hung = cuda.probe_with_deadline(0.5, lambda: FakeLibcuda(hang_s=60))
    assert hung.error is not None and hung.error.startswith("timeout")
    assert occ.cuda(hung, 8)[0].severity is Severity.DRAIN


# --- NVML reads (fake pynvml) ------------------------------------------------------------------


class OccupancyNvml(FakeNvml):
    """The fake pynvml with the issue-39 calls: v2 memory info, compute processes, fabric info."""

    def __init__(self, gpus, procs=None, fabric=None, used_mib: int = 1, v2: bool = True):
        super().__init__(gpus)
        self.nvmlMemory_v2 = pynvml.nvmlMemory_v2
        self.c_nvmlGpuFabricInfoV_t = pynvml.c_nvmlGpuFabricInfoV_t
        self.procs = procs or {}
        self.fabric = fabric  # (state, status) or None: NOT_SUPPORTED
        self.used_mib = used_mib
        self.v2 = v2

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        self._gpu("nvmlDeviceGetMemoryInfo", h)
        if version is not None and not self.v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return SimpleNamespace(total=81559 * MIB, used=self.used_mib * MIB, free=0, reserved=544 * MIB)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._gpu("nvmlDeviceGetComputeRunningProcesses", h)
        return [SimpleNamespace(pid=pid, usedGpuMemory=mib * MIB) for pid, mib in self.procs.get(h, [])]

    def nvmlDeviceGetGpuFabricInfoV(self, h, ref):
        self._gpu("nvmlDeviceGetGpuFabricInfoV", h)
        if self.fabric is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert ref._obj.version == pynvml.nvmlGpuFabricInfo_v2
        ref._obj.state, ref._obj.status = self.fabric
        return pynvml.NVML_SUCCESS


def test_nvml_read_fills_memory_processes_and_fabric_and_they_round_trip() -> None:
    nv = OccupancyNvml(h100_node(2), procs={1: [(4194000, 4000)]}, used_mib=4001,
                       fabric=(pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, pynvml.NVML_SUCCESS))
    snap = reader.read_snapshot(nv, hostname="n1")
    g0, g1 = snap.gpus
    assert (g0.memory.total_mib, g0.memory.used_mib, g0.memory.reserved_mib) == (81559, 4001, 544)
    assert g0.processes == [] and [(p.pid, p.used_mib) for p in g1.processes] == [(4194000, 4000)]
    assert g1.fabric.state == "in_progress" and g1.fabric.status == "NVML_SUCCESS"
    again = NodeSnapshot.from_dict(snap.to_dict())
    assert again == snap
    assert [f.gpu for f in occ.fabric(again)] == [0, 1]


def test_nvml_without_fabric_or_v2_memory() -> None:
    nv = OccupancyNvml(h100_node(1), fabric=None, v2=False)
    g = reader.read_snapshot(nv, hostname="n1").gpus[0]
    assert g.fabric is None and g.memory.reserved_mib is None and g.memory.used_mib == 1
    assert "fabric" not in reader.read_snapshot(nv, hostname="n1").to_dict()["gpus"][0]


def test_fabric_error_status_is_named() -> None:
    nv = OccupancyNvml(h100_node(1), fabric=(pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_ERROR_UNKNOWN))
    g = reader.read_snapshot(nv, hostname="n1").gpus[0]
    assert (g.fabric.state, g.fabric.status) == ("completed", "NVML_ERROR_UNKNOWN")


def test_snapshot_keys_have_their_types_checked(tmp_path) -> None:
    bad = snap_with(g0={"processes": [{"pid": "x"}]})
    with pytest.raises(SlurmagentError, match=r"gpus\[0\].processes\[0\] needs an integer 'pid'"):
        load(write_json(tmp_path / "bad.json", bad))
    assert load(write_json(tmp_path / "ok.json", snap_with(g2=LEFTOVER))).gpus[2].processes[0].name == "python"


# --- through the hooks' runtime -----------------------------------------------------------------


def test_epilog_decision_line_records_what_the_job_left_and_prolog_drains(tmp_path) -> None:
    path = write_json(tmp_path / "snap.json", snap_with(g2=LEFTOVER))
    cfg = parse({"state_dir": str(tmp_path / "state"), "hooks": {"syslog": False},
                 "health": {"snapshot": str(path), "expected_gpus": 8, "kernel_log_enabled": False,
                            "leftover_grace_s": 0}}, "test")
    fake = FakeSlurm(stamp="2026-11-30T05:00:00")
    fake.add_job("42", "COMPLETING")
    fake.add_job("43", "RUNNING")
    factory = lambda c: Slurm("scontrol", 3, runner=fake)  # noqa: E731
    seams = Recorder(owners={4242: "42"}, running=set()).seams()
    env = {"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"}
    epilog = functools.partial(evaluate, layer="epilog", job="42", seams=seams)
    assert run_hook(HookContext.from_env("epilog", env), lambda: cfg, epilog, slurm_factory=factory,
                    stderr=io.StringIO()) == 0
    line = read_records(tmp_path / "state" / "hooks.log")[-1]
    assert line["event"] == "epilog" and line["verdict"] == "healthy" and line["job"] == "42"
    assert line["warnings"] == ["gpu-leftover-processes: gpu 2 job 42 left pid 4242 (python, alice) holds 4000 MiB "
                                "after the job ended"]
    prolog = functools.partial(evaluate, layer="prolog", job="43", seams=seams)
    env = {"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "43"}
    assert run_hook(HookContext.from_env("prolog", env), lambda: cfg, prolog, slurm_factory=factory,
                    stderr=io.StringIO()) == 1
    line = read_records(tmp_path / "state" / "hooks.log")[-1]
    assert line["verdict"] == "unhealthy" and line["rule"] == "gpu-leftover-processes" and line["gpu"] == 2


def test_kill_switch_of_an_nvml_family(tmp_path) -> None:
    data = healthy_snapshot_dict(8)
    data["gpus"][3]["xid_events"] = [{"xid": 79}]
    path = write_json(tmp_path / "snap.json", data)
    base = {"snapshot": str(path), "expected_gpus": 8, "kernel_log_enabled": False}
    assert not evaluate(parse({"health": base}, "t"), "n1", False, layer="prolog").healthy
    cfg = parse({"health": base, "checks": {"off": ["gpu-xid"]}}, "t")
    assert evaluate(cfg, "n1", False, layer="prolog").findings == []


def test_a_snapshot_records_what_cuinit_answered_unless_the_check_is_off(tmp_path) -> None:
    """`slurmagent snapshot` on a GPU machine (gpu-probe.sh) keeps CUDA's answer in the replay file."""
    from slurmagent.commands.health import capture_snapshot
    from slurmagent.state.config import parse as parse_config

    asked: list[float] = []

    def read(timeout_s, hostname):
        return NodeSnapshot.from_dict(healthy_snapshot_dict(8))

    def probe(timeout_s):
        asked.append(timeout_s)
        return CudaProbe(error="CUDA_ERROR_SYSTEM_NOT_READY")

    cfg = parse_config({"state_dir": str(tmp_path), "health": {"cuda_timeout_s": 7}})
    snap = capture_snapshot(cfg, "n1", read, probe)
    assert asked == [7] and json.loads(snap.to_json())["cuda"] == {"error": "CUDA_ERROR_SYSTEM_NOT_READY"}
    off = parse_config({"state_dir": str(tmp_path), "checks": {"off": ["cuda-init"]}})
    assert capture_snapshot(off, "n1", read, probe).cuda is None and asked == [7]
    broken = NodeSnapshot.from_dict({**healthy_snapshot_dict(0), "nvml_error": "NVML_ERROR_DRIVER_NOT_LOADED"})
    assert capture_snapshot(cfg, "n1", lambda t, hostname: broken, probe).cuda is None and asked == [7]
