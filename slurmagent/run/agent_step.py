"""Running the node agents' `srun --overlap` step: its environment, its deadline, its cancel.

The step runs inside the batch step's environment, which carries the user's srun settings
for the trainer's steps; several would break ours: output to files or labelled or unbuffered
(`SLURM_STDOUTMODE`, `SLURM_LABELIO`, `SLURM_UNBUFFEREDIO`: no report, or torn ones), no
environment for the agents (`sbatch --export=NONE` leaves `SLURM_EXPORT_ENV=NONE`), the
trainer's step shape (8 tasks, GPUs). `agent_env` drops them, and the launcher passes every
option the step depends on explicitly (`--export=ALL`, `--input=none`, `--chdir`...).

A step that outlives its deadline, or that its caller cancels (the flush, while one agent
hangs), is ended by SIGTERM to srun: srun then kills the step's tasks on every node (SIGKILL,
"forcing job termination"), even a task that ignores SIGTERM; srun itself is killed when it
does not exit within STOP_WAIT_S. What the finished agents sent is kept.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

STOP_WAIT_S = 10.0  # srun waits up to 7 s for the killed step ("Job step aborted: Waiting up to 7 seconds")
POLL_S = 0.25

# Step-request variables of the batch environment that would shape our one-task-per-node
# step like the trainer's (8 tasks, GPUs, memory per CPU...); the agent step sets its own.
STEP_REQUEST_VARS = (
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS_PER_SOCKET", "SLURM_NTASKS_PER_CORE",
    "SLURM_NTASKS_PER_GPU", "SLURM_NTASKS_PER_TRES", "SLURM_CPUS_PER_TASK", "SRUN_CPUS_PER_TASK",
    "SLURM_CPUS_PER_GPU",
    "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_GPU", "SLURM_GPUS", "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET", "SLURM_TRES_PER_TASK", "SLURM_DISTRIBUTION", "SLURM_DIST_PLANESIZE",
    "SLURM_CPU_BIND", "SLURM_MEM_BIND", "SLURM_GPU_BIND", "SLURM_HINT", "SLURM_EXACT", "SLURM_OVERLAP", "SLURM_STEP_GRES",
    "SLURM_GRES", "SLURM_GRES_FLAGS", "SLURM_NETWORK", "SLURM_THREADS", "SLURM_THREADS_PER_CORE", "SLURM_CORE_SPEC",
    "SLURM_THREAD_SPEC", "SLURM_SPREAD_JOB", "SLURM_USE_MIN_NODES", "SLURM_EXCLUSIVE", "SLURM_OVERCOMMIT",
    "SLURM_CONSTRAINT", "SLURM_CPU_FREQ_REQ", "SLURM_GPU_FREQ", "SLURM_RESV_PORTS", "SLURM_TIMELIMIT",
)
# How srun handles the tasks' I/O, environment, directory and life: the report channel needs
# stdout back, whole lines, unlabelled; the agents need the batch step's environment.
STEP_IO_VARS = (
    "SLURM_LABELIO", "SLURM_STDOUTMODE", "SLURM_STDERRMODE", "SLURM_STDINMODE", "SLURM_UNBUFFEREDIO",
    "SLURM_OPEN_MODE", "SRUN_OUTPUT", "SRUN_ERROR", "SRUN_INPUT", "SLURM_EXPORT_ENV", "SRUN_EXPORT_ENV",
    "SLURM_WORKING_DIR", "SRUN_CONTAINER", "SLURM_CONTAINER", "SLURM_BCAST", "SLURM_BCAST_EXCLUDE", "SLURM_SEND_LIBS",
    "SLURM_COMPRESS", "SLURM_TEST_EXEC", "SLURM_PROLOG", "SLURM_EPILOG", "SLURM_TASK_PROLOG", "SLURM_TASK_EPILOG",
    "SLURM_WAIT", "SLURM_NO_KILL", "SLURM_KILL_BAD_EXIT", "SLURM_SIGNAL", "SLURM_EXIT_IMMEDIATE", "SLURM_IMMEDIATE",
    "SLURM_PROFILE", "SLURM_MPI_TYPE", "SLURM_DISABLE_STATUS",
)


def agent_env(env: Mapping[str, str]) -> dict[str, str]:
    """The batch environment without the variables that would reshape the agent step."""
    drop = {*STEP_REQUEST_VARS, *STEP_IO_VARS}
    return {k: v for k, v in env.items() if k not in drop}


@dataclass(frozen=True)
class StepOutput:
    stdout: str
    stderr: str
    returncode: int | None
    ended: str = ""  # "" (srun exited), "deadline" or "cancelled"
    seconds: float = 0.0


def run_step(argv: list[str], env: Mapping[str, str], deadline_s: float,
             cancel: threading.Event | None = None) -> StepOutput:
    """Run srun to its end, its deadline or `cancel`, whichever comes first (an OSError
    starting it is the caller's)."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    ended = ""
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=POLL_S)  # a retry after a timeout loses no output
            break
        except subprocess.TimeoutExpired:
            if cancel is not None and cancel.is_set():
                ended = "cancelled"
            elif time.monotonic() - started >= deadline_s:
                ended = "deadline"
            else:
                continue
            stdout, stderr = stop_step(proc)
            break
    return StepOutput(stdout or "", stderr or "", proc.returncode, ended, time.monotonic() - started)


def stop_step(proc: subprocess.Popen) -> tuple[str, str]:
    """End the step on every node: SIGTERM to srun's process group (srun kills the step's
    tasks), then SIGKILL when srun is still there after STOP_WAIT_S."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        return proc.communicate(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.communicate()


class Rounds:
    """The agent steps of one job, numbered when asked for: `cancel` (the flush) ends the one in
    flight and every one asked for before it, even one still waiting for its turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # never held while a step runs
        self._asked = 0
        self._cancelled_upto = 0
        self._in_flight: threading.Event | None = None

    def ticket(self) -> int:
        with self._lock:
            self._asked += 1
            return self._asked

    def cancel(self) -> None:
        with self._lock:
            self._cancelled_upto = self._asked
            if self._in_flight is not None:
                self._in_flight.set()

    @contextmanager
    def running(self, ticket: int) -> Iterator[threading.Event]:
        """The cancel event of the round `ticket` while it runs (already set when cancelled)."""
        event = threading.Event()
        with self._lock:
            if ticket <= self._cancelled_upto:
                event.set()
            self._in_flight = event
        try:
            yield event
        finally:
            with self._lock:
                self._in_flight = None
