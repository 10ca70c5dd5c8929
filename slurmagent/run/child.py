"""The wrapped command's process group: signals to it, stopping and reaping it, and its
own requeue held until the final checkpoint sync (`RequeueHold`).

The child runs in a session of its own, so a signal reaches every process of the trainer;
a process stuck in the kernel on a dead GPU is left behind rather than waited on forever.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from .requeue import RequeueVerb
from ..state.private_dirs import user_tmp_parent
from .job import JOB_ID_RE, signal_name

REAP_WAIT_S = 10.0  # after SIGKILL: a child stuck in uninterruptible sleep is left behind after this


# --- the job's own requeue, held ----------------------------------------------------------

def _anycase(word: str) -> str:
    """A POSIX sh `case` pattern matching `word` in any letter case (scontrol's own rule)."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in word)


def _prefixes(word: str, shortest: int) -> str:
    return "|".join(_anycase(word[:n]) for n in range(shortest, len(word) + 1))


# scontrol's words, as scontrol 22.05-24.11 reads them: `requeue` may be shortened to 3 letters,
# `requeuehold` may not; flags `Incomplete` (any prefix) and `State=SpecialExit` (or `State=SE`)
# come before the job lists; a job list is `ID[,ID...]`, maybe after `JobId=` or `Job=`.
_SHIM_WORDS = {
    "@REQUEUE@": _prefixes("requeue", 3),
    "@REQUEUEHOLD@": _anycase("requeuehold"),
    "@INCOMPLETE@": _prefixes("incomplete", 1),
    "@SPECIALEXIT@": f"{_anycase('state=specialexit')}*|{_anycase('state=se')}*",
    "@JOBKEY@": f"{_anycase('jobid=')}*|{_anycase('job=')}*",
}

SHIM = """#!/bin/sh
# Written by `slurmagent run` for this job only. The job's own requeue of itself
# (`scontrol [-Q|-v|...] requeue|requeuehold [Incomplete|State=SpecialExit] ID[,ID...]`:
# PyTorch Lightning's auto-requeue, submitit) is held: the wrapper asks it once, after its
# final checkpoint sync. Other jobs named with ours, an option not known here (-M, -u), and
# every other scontrol call go to the real one. Arguments are data: no eval, no word splitting.
sub= special= mine= rest= pre=0 words=0
for a do
  case $a in
    --quiet|--verbose|--oneliner|--details|--all|--future|--local|--sibling) continue ;;
    -|--*|-*[!QvodaF]*) exec {real} "$@" ;;
    -?*) continue ;;
  esac
  words=$((words + 1))
  if [ -z "$sub" ]; then
    case $a in
      @REQUEUE@) sub=requeue ;;
      @REQUEUEHOLD@) sub=requeuehold ;;
      *) exec {real} "$@" ;;
    esac
    pre=1
    continue
  fi
  if [ "$words" -eq "$((pre + 1))" ]; then
    case $a in
      @INCOMPLETE@) pre=$((pre + 1)); continue ;;
      @SPECIALEXIT@) special=1; pre=$((pre + 1)); continue ;;
    esac
  fi
  case $a in @JOBKEY@) a=${{a#*=}} ;; esac
  list=$a,
  while [ -n "$list" ]; do
    id=${{list%%,*}}
    list=${{list#*,}}
    case $id in
      {ids}) mine=$id ;;
      *) rest=${{rest:+$rest,}}$id ;;
    esac
  done
done
[ -n "$mine" ] || exec {real} "$@"
if [ "$sub" = requeuehold ] && [ -n "$special" ]; then
  echo requeuehold-specialexit >> {request}
else
  echo "$sub" >> {request}
fi
echo "slurmagent: $sub of job $mine held until the checkpoint is synced" >&2
[ -n "$rest" ] || exit 0
# The other jobs named with ours: the same options, subcommand and flags, their ids only.
k=0
for a do
  shift
  case $a in
    -?*) ;;
    *) k=$((k + 1)); [ "$k" -gt "$pre" ] && continue ;;
  esac
  set -- "$@" "$a"
done
exec {real} "$@" "$rest"
"""
for _word, _pattern in _SHIM_WORDS.items():
    SHIM = SHIM.replace(_word, _pattern)
# What the shim records, and what the wrapper then asks of Slurm once.
HELD_VERBS = {"requeue": RequeueVerb(), "requeuehold": RequeueVerb(hold=True),
              "requeuehold-specialexit": RequeueVerb(hold=True, special_exit=True)}


class RequeueHold:
    """A private directory (0700, in `${TMPDIR:-/tmp}/slurmagent-<uid>/`) put first on the
    child's PATH, holding an `scontrol` that records the child's requeue of its own job in a
    file there and exits 0."""

    def __init__(self, job_ids: tuple[str, ...], real_scontrol: str, base: str | None = None):
        if not job_ids or not all(JOB_ID_RE.fullmatch(i) for i in job_ids):
            raise ValueError(f"not Slurm job ids: {job_ids!r}")
        # In the user's private parent (0700), never in a shared TMPDIR: srun carries the PATH
        # to every node, where a multi-node job's node agents create this same path privately.
        self.dir = Path(tempfile.mkdtemp(prefix="slurmagent-hold-", dir=base or user_tmp_parent()))
        self.request = self.dir / "requeue-requested"
        self.kept_verb = RequeueVerb()
        shim = self.dir / "scontrol"
        shim.write_text(SHIM.format(ids="|".join(job_ids), request=shlex.quote(str(self.request)),
                                    real=shlex.quote(real_scontrol)))
        shim.chmod(0o700)

    def child_path(self, path: str | None) -> str:
        return f"{self.dir}{os.pathsep}{path}" if path else str(self.dir)

    def requested(self) -> bool:
        return self.request.exists()

    def verb(self) -> RequeueVerb:
        """What the job asked last (`requeue`, or `requeuehold [State=SpecialExit]`): the wrapper
        asks the same once its final sync is done. The file is the job's to write: anything
        else in it is a plain requeue."""
        try:
            lines = self.request.read_text(errors="replace").split()
        except OSError:
            return self.kept_verb
        return HELD_VERBS.get(lines[-1], RequeueVerb()) if lines else RequeueVerb()

    def cleanup(self) -> None:
        if self.request.exists():
            self.kept_verb = self.verb()  # asked once the final sync is done, after this clean-up
        shutil.rmtree(self.dir, ignore_errors=True)



# --- the child's process group ------------------------------------------------------------


EXIT_CHILD_SIGNALLED = 76  # the command died of a signal (or exited 128+N) without a flush: 143 keeps its meaning
EXIT_SETTLE_S = 0.3  # after the command exits: how long a flush signal may still be on its way


def signal_at_exit(pending: list[int], wanted: tuple[int, ...], clock: Callable[[], float],
                   settle_s: float = EXIT_SETTLE_S) -> int | None:
    """The first of `wanted` recorded in `pending` (which is then cleared), waiting up to
    `settle_s` for one still on its way (the sender signals the job's processes one by one);
    None when none came."""
    end = clock() + settle_s
    while True:
        found = [s for s in pending if s in wanted]
        if found:
            pending.clear()
            return found[0]
        if clock() >= end:
            return None
        time.sleep(0.02)


def exit_by_itself(code: int) -> tuple[int, str]:
    """The exit code and last line of a command that ended without a flush: its own code, or
    EXIT_CHILD_SIGNALLED and the signal's name when it died of one, so 143 means one thing."""
    signum = death_signal(code)
    if signum is None:
        return code, f"exit {code}: the job's own exit code (it ended by itself)"
    how = "killed by it" if code < 0 else f"it exited {code}, as a shell or srun reports a signal"
    return EXIT_CHILD_SIGNALLED, (f"exit {EXIT_CHILD_SIGNALLED}: the job died of {signal_name(signum)} without a "
                                  f"flush ({how})")


def death_signal(returncode: int) -> int | None:
    """The signal the command died of: killed by it (a negative return code), or an exit code
    128+N by which a shell, or srun for its tasks (143 when they got SIGTERM), reports signal N.
    None for any other exit code."""
    if returncode < 0:
        return -returncode
    if returncode > 128 and returncode - 128 in signal.valid_signals():
        return returncode - 128
    return None


class KillWatch:
    """During a flush: a SIGTERM or SIGCONT reaching the wrapper now (after the one that started
    it) means Slurm is requeueing or killing the job, and SIGKILLs it KillWait later, maybe in the
    middle of the final sync. Said at once, from a thread (the main thread is busy syncing), so
    the line is on stderr before the kill: a framework that called scontrol by its absolute path
    is the usual cause, and the hold cannot catch that call."""

    WATCHED = (signal.SIGTERM, signal.SIGCONT)

    def __init__(self, pending: list[int], say: Callable[[str], None], job: str, interval_s: float = 0.05):
        self.pending, self.say, self.job, self.interval_s = pending, say, job, interval_s
        self.phase = "flush"
        self.said = False
        self._seen = len(pending)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kill-watch", daemon=True)

    def __enter__(self) -> KillWatch:
        self._seen = len(self.pending)
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(1.0)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            arrived = [s for s in self.pending[self._seen:] if s in self.WATCHED]
            if arrived and self.phase:  # phase "": our own requeue is asked now, its kill is expected
                self.said = True
                self.say(f"{signal.Signals(arrived[0]).name}: job {self.job} is being requeued/killed by Slurm during "
                         f"the {self.phase} (it kills this wrapper KillWait seconds later); a framework that calls "
                         "scontrol by its absolute path (e.g. /usr/bin/scontrol requeue) cannot be held: call "
                         "`scontrol` from PATH or turn the framework's own requeue off, so the wrapper requeues "
                         "after its final sync")
                return


def terminate_group(child: subprocess.Popen, wait_s: float, say: Callable[[str], None]) -> bool:
    """SIGTERM to the child's group, then SIGKILL after `wait_s`; True when it left by itself."""
    killpg(child, signal.SIGTERM)
    try:
        child.wait(timeout=wait_s)
        return True
    except subprocess.TimeoutExpired:
        killpg(child, signal.SIGKILL)
        if not reap(child, REAP_WAIT_S):
            say(f"the job did not die {REAP_WAIT_S:g} s after SIGKILL (stuck in the kernel?): "
                "leaving it behind to sync and requeue")
        return False


def kill_group(child: subprocess.Popen, say: Callable[[str], None]) -> bool:
    """SIGKILL to the child's whole group, whatever is left of it (a stopped rank outlives its
    launcher); True when the child was still there to kill. No SIGTERM: a trainer's handler takes
    it as the checkpoint signal, and a rank that saves while another is hung may leave a
    checkpoint of mixed steps (the hang watch's end)."""
    alive = child.poll() is None
    killpg(child, signal.SIGKILL)  # the launcher gone, what it started may not be
    if alive and not reap(child, REAP_WAIT_S):
        say(f"the job did not die {REAP_WAIT_S:g} s after SIGKILL (stuck in the kernel?): leaving it behind")
    return alive


def reap(child: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for a killed child at most `timeout_s`; False when it is still there (a process in
    uninterruptible sleep, e.g. a driver call on a dead GPU, dies only when that call returns)."""
    try:
        child.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def killpg(child: subprocess.Popen, signum: int) -> None:
    """Signal the child's whole group (the trainer's workers too); the child alone when the group is not ours."""
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass
