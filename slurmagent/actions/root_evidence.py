"""What root sees itself before it drains a node that a job's wrapper asked it to drain.

The wrapper runs as the job's user: what it says is a claim. Root drains a node for a job only
on evidence it can read on this node itself (actions/job_channel.py calls this once per job):

* a hang: the rank process the request names (`pid`) is a process of that job on this node,
  of the job's user, and is stopped (T; never a tracer's `t`) or a zombie (Z) -- `/proc`, read by root; or this
  node's own GPU check (`slurmagent check`) shows a fault now. A rank that is "gone" cannot
  be told apart from a made-up pid, and a rank that "stopped first" is a timing: neither
  drains (the wrapper then asks that node's root to count the hang against it: `count_evidence`);
* a hang on another node: this root cannot see it; that node's root judges it (the job's
  node agent there asks it);
* a straggler: slowness is a measure root cannot repeat; it drains only where this node's
  own config says `[run] straggler_action = "drain"` (the admin's choice to take the job's
  measure), else it is refused (the job reports it instead).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..policy.job_requests import JobRequest
from ..slurm.job_processes import job_process_state
from ..slurm.model import JobOwner
from ..state.config import Config
from ..state.repair_state import hang_counted_today

STOPPED = {"T": "stopped (T)", "Z": "a zombie (Z)"}  # never `t`: a tracer's stop (py-spy, gdb) is for moments


GPU_CHECK_REUSE_S = 60.0  # one check answers every drain asked meanwhile: many jobs' asks cost one check
_gpu_lock = threading.Lock()
_gpu_seen: list[tuple[float, str]] = []


def node_gpu_fault() -> str:
    """This node's GPU fault in one line, or "" (root runs its own `slurmagent check --json`, one
    at a time, its answer reused `GPU_CHECK_REUSE_S`)."""
    from ..hang.evidence import gpu_state  # start-up speed: only for a drain a job asked

    with _gpu_lock:
        if _gpu_seen and time.monotonic() - _gpu_seen[0][0] < GPU_CHECK_REUSE_S:
            return _gpu_seen[0][1]
        fault = gpu_state()[1]
        _gpu_seen[:] = [(time.monotonic(), fault)]
        return fault


def count_evidence(req: JobRequest, owner: JobOwner, node: str, state_dir, uid: int, proc: str = "/proc") -> str:
    """Why root will not count this hang against this node ("" = it will): the rank the request
    names must be a process of the job here (the evidence named this node through it), and the
    job's user must not have counted one against this node in the last day (kept in root's state)."""
    if not req.pid or job_process_state(req.pid, owner.own_id or owner.job, owner.uid, proc) is None:
        return (f"no rank of job {owner.job} named on {node} (pid {req.pid or 'none'}): a hang counts only against "
                "the node its evidence names")
    if hang_counted_today(state_dir, node, owner.uid, time.time()):
        return f"uid {owner.uid} already counted a hang against {node} in the last day"
    return ""


def drain_evidence(req: JobRequest, owner: JobOwner, node: str, cfg: Config, *, proc: str = "/proc",
                   gpu_fault: Callable[[], str] = node_gpu_fault) -> tuple[bool, str]:
    """(drain, what root saw): True with root's own evidence, False with why root will not."""
    if req.rule == "straggler":
        if cfg.run.straggler_action == "drain":
            return True, "straggler_action = drain in this node's config"
        return False, "this node's config says straggler_action = report: a straggler is reported, not drained"
    if req.node != node:
        return False, f"root on {node} cannot see {req.node}: that node's own root judges a drain of it"
    seen = "named no rank process"
    if req.pid:
        state = job_process_state(req.pid, owner.own_id or owner.job, owner.uid, proc)
        if state in STOPPED:
            return True, f"root saw pid {req.pid} of job {owner.job} {STOPPED[state]}"
        seen = f"pid {req.pid} is {'not a process of job ' + owner.job + ' here' if state is None else f'running ({state})'}"
    fault = gpu_fault()
    if fault:
        return True, f"root's GPU check: {fault}"
    return False, f"root sees no fault on {node} ({seen}, no GPU fault): a job's word alone drains nothing"
