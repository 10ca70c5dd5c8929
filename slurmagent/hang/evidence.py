"""What a hung job looks like on this node, read before anything is killed.

Per rank: its process state from `/proc/<pid>/stat` (R running, S sleeping, D in the kernel,
T stopped, Z zombie, or gone: no such process in the job's session); a Python stack of each
rank with py-spy when it is installed (it needs ptrace rights over the ranks, which
`kernel.yama.ptrace_scope` may deny: said in the dump); the node's GPU state
(`slurmagent check --json`); PyTorch's NCCL flight-recorder dump of each rank, asked through
its pipe where the job enabled it. Every call has a deadline; the folder is written beside the
job's output (`<output>.hang-<attempt>/`).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

from ..policy.stall import RankState
from ..state.host import slurmagent_argv
from ..slurm.job_processes import proc_stat  # noqa: F401 - one reader of /proc/<pid>/stat; callers use evidence.proc_stat
from ..state.progress import RankProgress

PY_SPY_TIMEOUT_S = 10.0
GPU_TIMEOUT_S = 20.0
MAX_DUMPS = 16


def session_processes(sid: int, proc: str = "/proc") -> list[tuple[int, str, str]]:
    """(pid, state, command line) of every process in the job's session."""
    out = []
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        st = proc_stat(int(name), proc)
        if st is None or st[1] != sid:
            continue
        try:
            cmd = Path(proc, name, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = ""
        out.append((int(name), st[0], cmd[:300]))
    return sorted(out)


def rank_states(progress: dict[int, RankProgress], node: str, proc: str = "/proc") -> list[RankState]:
    """Each rank that reported progress, with its process's state now ("gone" when its pid is
    not there any more). A rank outside the wrapper's session counts too (started by `srun`
    inside the job, it is slurmstepd's child)."""
    out = []
    for rank, p in sorted(progress.items()):
        st = proc_stat(p.pid, proc)
        state = "gone" if st is None else st[0]
        out.append(RankState(rank, node, p.pid, state, p.step, p.at))
    return out


def ptrace_scope(path: str = "/proc/sys/kernel/yama/ptrace_scope") -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def py_spy_exe() -> str | None:
    """py-spy on PATH, else beside this interpreter: `pip install 'slurmagent[hang]'` puts it in
    the venv's bin/, which a job's PATH seldom holds (the wrapper runs as `<venv>/bin/python -m
    slurmagent.entry run`)."""
    return shutil.which("py-spy") or shutil.which(str(Path(sys.executable).parent / "py-spy"))


def py_spy_dumps(pids: list[int], timeout_s: float = PY_SPY_TIMEOUT_S) -> dict[int, str]:
    """pid -> `py-spy dump` text (or why there is none), all at once within `timeout_s`."""
    exe = py_spy_exe()
    if exe is None:
        return {pid: "py-spy is not installed (pip install 'slurmagent[hang]')" for pid in pids}
    scope = ptrace_scope()
    out: dict[int, str] = {}

    def dump(pid: int) -> None:
        # Always --nonblocking: py-spy would otherwise ptrace-stop the rank while it reads it (a `t`
        # in its stat that another sample or the stall rule could take for a stopped rank), and it
        # cannot suspend one already stopped (`T`: "Failed to suspend process"). Read as it stands.
        try:
            proc = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
            text = proc.stdout + (f"\n(py-spy exit {proc.returncode}) {proc.stderr.strip()}" if proc.returncode else "")
            if proc.returncode and scope is not None and scope >= 1 and "ermission" in proc.stderr:
                text += (f"\nkernel.yama.ptrace_scope = {scope} denies py-spy this process: set it to 0, or give "
                         "py-spy CAP_SYS_PTRACE")
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"py-spy dump failed: {exc}"
        out[pid] = text

    threads = [threading.Thread(target=dump, args=(pid,), daemon=True) for pid in pids[:MAX_DUMPS]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 2)
    return {pid: out.get(pid, "py-spy dump did not finish in time") for pid in pids[:MAX_DUMPS]}


# PyTorch's flight recorder (ProcessGroupNCCL's DumpPipe): with a trace buffer and a pipe stem set,
# each rank makes a FIFO `<stem><rank>.pipe` and dumps its trace (to `<dump stem><rank>`) when
# anything is written there. Its own dump comes on its own timeout, after ours; newer PyTorch
# reads the TORCH_FR_* names first.
FR_PIPE_VARS = ("TORCH_FR_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
FR_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_DUMP_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def _first(env: dict[str, str], names: tuple[str, ...]) -> tuple[str, str]:
    return next(((n, env[n]) for n in names if env.get(n)), ("", ""))


def flight_recorder_dumps(ranks: list[int], env: dict[str, str] | None = None) -> str:
    """Ask each rank's NCCL flight recorder for its dump, where the job enabled it: one write to
    the rank's pipe, never blocking (O_NONBLOCK: no reader, no write), never following a link or
    writing anything but a FIFO. Returns what was done, one line per rank ("" when not enabled).
    Runs as the job's user (the wrapper or its node agent), like the ranks themselves."""
    env = os.environ if env is None else env
    var, stem = _first(env, FR_PIPE_VARS)
    if not stem or not ranks:
        return ""
    size_var, size = _first(env, FR_BUFFER_VARS)
    if not size.strip().lstrip("-").isdigit() or int(size) <= 0:
        return (f"NCCL flight recorder: {var} is set but {' or '.join(FR_BUFFER_VARS)} is not a positive "
                "number: PyTorch keeps no trace, none asked\n")
    dump = _first(env, FR_DUMP_VARS)[1] or "/tmp/nccl_trace_rank_"
    lines = []
    for rank in sorted(set(ranks)):
        pipe = f"{stem}{rank}.pipe"
        try:
            if not stat.S_ISFIFO(os.lstat(pipe).st_mode):
                lines.append(f"rank {rank}: {pipe} is not a pipe: not written")
                continue
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            try:
                os.write(fd, b"1\n")
            finally:
                os.close(fd)
            lines.append(f"rank {rank}: dump asked through {pipe}; PyTorch writes it to {dump}{rank}")
        except OSError as exc:  # ENOENT: no such rank here or no NCCL group; ENXIO: nobody reads it
            lines.append(f"rank {rank}: {pipe}: {exc.strerror or exc}: no dump asked")
    return "".join(f"NCCL flight recorder ({var}, {size_var}={size}): {line}\n" for line in lines)


def gpu_state(timeout_s: float = GPU_TIMEOUT_S) -> tuple[str, str]:
    """(this node's `slurmagent check --json`, its GPU fault in one line or "")."""
    try:
        proc = subprocess.run([*slurmagent_argv(), "check", "--json"], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"slurmagent check --json failed: {exc}", ""
    fault = ""
    try:
        doc = json.loads(proc.stdout)
        gpu_node = isinstance(doc, dict) and bool(doc.get("gpus_seen") or doc.get("expected_gpus"))
        findings = doc.get("findings", []) if gpu_node else []  # a node without GPUs: no GPU fault to blame
        bad = [f for f in findings if isinstance(f, dict) and f.get("severity") == "drain"]
        if bad:
            fault = str(bad[0].get("summary") or bad[0].get("rule") or "")[:200]
    except ValueError:
        pass
    return proc.stdout + (proc.stderr and f"\n# stderr\n{proc.stderr}"), fault


def output_file(fd: int = 1) -> Path | None:
    """The job's output file when our stdout is one (the batch step's StdOut)."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
    return path if path.is_absolute() and not str(path).endswith(" (deleted)") else None


def evidence_dir(output: Path | None, cwd: Path, name: str, attempt: int) -> Path:
    """`<output>.hang-<attempt>/`, or under the working directory when the output is not a
    file; a new name when that one exists (an earlier run's)."""
    base = Path(f"{output}.hang-{attempt}") if output is not None else cwd / f"{name}.hang-{attempt}"
    path, n = base, 1
    while os.path.lexists(path):
        n += 1
        path = Path(f"{base}.{n}")
    return path


def write_folder(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(mode=0o700, parents=False)
    for name, text in files.items():
        (path / name).write_text(text)
    return path
