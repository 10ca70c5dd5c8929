"""ONE node and job model, parsed from `scontrol -o show node|job` lines, with pure predicates.

Node state is Slurm's `State` split on `+` into flags; the predicates say what slurmagent
may do with a node (`ours`: drained by slurmagent, the only nodes it resumes or repairs;
`held_by_other`: an admin's or Slurm's drain, never touched). The node's Comment may carry
the breaker's mark (`slurmagent suppressed@<epoch> <summary>`), read by `marks`.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

from ..core import hostlist, reasons
from ..core.reasons import COMMENT_TAG
from ..core.timefmt import parse_slurm_time

# States in which slurmd has not (re)registered the node with slurmctld.
UNREGISTERED_FLAGS = frozenset({"DOWN", "NOT_RESPONDING", "UNKNOWN", "FUTURE", "POWERED_DOWN", "POWERING_UP",
                                "POWER_DOWN", "POWERING_DOWN", "REBOOT_ISSUED", "REBOOT_REQUESTED"})
BUSY_FLAGS = frozenset({"ALLOCATED", "MIXED", "COMPLETING"})
# A dynamic node (State=CLOUD, or Slurm power saving): Slurm makes its VM for a job
# (ResumeProgram) and deletes it when idle (SuspendProgram); the flags show while it is up or down.
DYNAMIC_FLAGS = frozenset({"CLOUD", "POWERED_DOWN", "POWERING_UP", "POWER_DOWN", "POWERING_DOWN", "POWER_UP"})
OPT_OUT_FEATURE = "slurmagent_off"  # a node feature: slurmagent leaves this node alone
_BASE_STATES = frozenset({"IDLE", "ALLOCATED", "MIXED", "DOWN", "UNKNOWN", "FUTURE", "ERROR"})

# scontrol appends `[user@time]` to a node's Reason: stripped, and the time kept when it is one.
_REASON_STAMP = re.compile(r" \[(?P<user>[^\]@]*)@(?P<time>[^\]]*)\]$")

# A field starts at a `Key=` token whose key is spelled as Slurm spells its keys (CamelCase).
_KEY = re.compile(r"[A-Z][A-Za-z0-9_:/]*")


def _fields(record: str) -> tuple[dict[str, str], dict[str, int]]:
    """Split one record on single spaces into fields; also count every `Key=` token seen."""
    out: dict[str, str] = {}
    seen: dict[str, int] = {}
    key = None
    for token in record.strip(" \n").split(" "):
        name, eq, value = token.partition("=")
        if eq and _KEY.fullmatch(name):
            seen[name] = seen.get(name, 0) + 1
            if name not in out:
                key = name
                out[key] = value
                continue
        if key is not None:
            out[key] += " " + token
    # scontrol pads some fields with a second space (`Partitions=gpu  BootTime=...`).
    return {k: v.rstrip(" ") for k, v in out.items()}, seen

# The fault flush: the watch tells a wrapped job's batch step that a GPU under it died with
# this signal (not USR1/TERM), so the wrapper waits only briefly for the trainer, which may
# hang on the dead GPU: the last committed checkpoint is what counts. SIGPWR: nothing else
# sends it to a batch step (Slurm uses TERM, KILL, CONT and the user's --signal), and a job
# not wrapped by a slurmagent that knows it is never sent it.
FAULT_FLUSH_SIGNAL = signal.SIGPWR


def parse_kv(line: str) -> dict[str, str]:
    """`scontrol -o` output: Key=Value tokens; Reason/Comment values may contain spaces.

    The first occurrence of a key wins and a repeated `Key=` is text of the field it appears
    in: a comment, path or reason that imitates fields neither overrides nor splits them.
    (A job's name comes before its state: `job_from_text` refuses a record where that matters.)"""
    return _fields(line)[0]


@dataclass(frozen=True)
class Marks:
    """What slurmagent wrote in a node's Comment."""

    drained_at: float | None = None
    suppressed_at: float | None = None
    suppressed_summary: str = ""

    @property
    def empty(self) -> bool:
        return self.drained_at is None and self.suppressed_at is None


def parse_comment(comment: str) -> Marks:
    if not comment.startswith(COMMENT_TAG + " "):
        return Marks()
    drained = suppressed = None
    summary: list[str] = []
    for token in comment.split(" ")[1:]:
        key, at, value = token.partition("@")
        if at and key in ("drained", "suppressed") and not summary:
            try:
                stamp = float(value)
            except ValueError:
                continue
            if key == "drained":
                drained = stamp
            else:
                suppressed = stamp
        elif token:
            summary.append(token)
    return Marks(drained, suppressed, " ".join(summary) if suppressed is not None else "")


@dataclass(frozen=True)
class NodeInfo:
    """One node as `scontrol -o show node` shows it."""
    name: str
    flags: frozenset[str]
    reason: str = ""
    reason_time: float | None = None  # epoch seconds of the reason (slurmctld's clock, 1 s resolution)
    comment: str = ""
    gres: str = ""
    partitions: str = ""
    slurmd_start: float | None = None
    raw: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags

    @property
    def down(self) -> bool:
        return "DOWN" in self.flags

    @property
    def ours(self) -> bool:
        """Drained by slurmagent: the only nodes slurmagent resumes or repairs."""
        return self.drained and reasons.is_ours(self.reason)

    @property
    def held_by_other(self) -> bool:
        """Drained or down for a reason that is not ours (an admin or Slurm itself)."""
        return (self.drained or self.down) and not reasons.is_ours(self.reason)

    drained_by_slurmagent = ours
    drained_by_other = held_by_other

    @property
    def planned_drain(self) -> bool:
        """Drained by slurmagent ahead of a scheduled end of the VM (expiry, maintenance, preemption)."""
        return self.ours and reasons.is_planned(self.reason)

    @property
    def fault_drain(self) -> bool:
        """Drained by slurmagent for a fault: what the circuit breaker counts."""
        return self.ours and not reasons.is_planned(self.reason)

    @property
    def repairing(self) -> bool:
        return self.ours and reasons.is_repairing(self.reason)

    @property
    def busy(self) -> bool:
        return bool(self.flags & BUSY_FLAGS)

    @property
    def registered(self) -> bool:
        return bool(self.flags) and not (self.flags & UNREGISTERED_FLAGS)

    @property
    def dynamic(self) -> bool:
        """A CLOUD / power-saving node: powered down (a fresh VM next time), never recreated in place."""
        return bool(self.flags & DYNAMIC_FLAGS)

    @property
    def features(self) -> frozenset[str]:
        """The node's features (available and active), e.g. the opt-out `slurmagent_off`."""
        found: set[str] = set()
        for key in ("AvailableFeatures", "ActiveFeatures", "Features"):
            value = self.raw.get(key, "")
            if value and value != "(null)":
                found.update(f for f in value.split(",") if f)
        return frozenset(found)

    @property
    def opted_out(self) -> bool:
        return OPT_OUT_FEATURE in self.features

    @property
    def boot_time(self) -> float | None:
        return parse_slurm_time(self.raw.get("BootTime", ""))

    @property
    def partition_names(self) -> list[str]:
        return [p for p in self.partitions.split(",") if p]

    @property
    def marks(self) -> Marks:
        return parse_comment(self.comment)

    @property
    def comment_free(self) -> bool:
        """We may write the comment: empty or already ours (never an admin's)."""
        return not self.comment or self.comment.startswith(COMMENT_TAG + " ")

    @property
    def state(self) -> str:
        return "+".join(sorted(self.flags, key=lambda f: (f not in _BASE_STATES, f)))


def node_from_kv(kv: dict[str, str]) -> NodeInfo:
    """One `scontrol -o show node` line, already split into Key=Value pairs."""
    flags = frozenset(f for f in re.split(r"[+*]", kv.get("State", "")) if f)
    reason = kv.get("Reason", "")
    reason_time = None
    m = _REASON_STAMP.search(reason)
    if m:
        reason_time = parse_slurm_time(m["time"])
        reason = reason[: m.start()]
    if reason == "(null)":
        reason = ""
    comment = kv.get("Comment", "")
    if comment == "(null)":
        comment = ""
    return NodeInfo(
        name=kv.get("NodeName", ""),
        flags=flags,
        reason=reason.strip(),
        reason_time=reason_time,
        comment=comment.strip(),
        gres=kv.get("Gres", ""),
        partitions=kv.get("Partitions", ""),
        slurmd_start=parse_slurm_time(kv.get("SlurmdStartTime", "")),
        raw=kv,
    )


def nodes_from_text(text: str) -> list[NodeInfo]:
    """Every node of a `scontrol -o show node` answer."""
    return [node_from_kv(parse_kv(line)) for line in text.splitlines() if line.startswith("NodeName=")]


@dataclass(frozen=True)
class JobInfo:
    """One job as `scontrol -o show job` shows it."""
    job_id: str
    state: str
    reason: str = ""
    restarts: int = 0
    requeue: bool = True
    node_list: str = ""
    batch_flag: bool = True
    time_limit: str = ""
    end_time: str = ""
    raw: dict | None = None
    ambiguous: tuple[str, ...] = ()  # fields the job's own text imitates: their values are unknown

    @property
    def held(self) -> bool:
        return self.state == "PENDING" and (
            self.reason in ("JobHeldAdmin", "JobHeldUser") or "held" in self.reason.lower()
        )


def job_from_kv(kv: dict[str, str]) -> JobInfo:
    return JobInfo(
        job_id=kv.get("JobId", ""),
        state=kv.get("JobState", ""),
        reason=kv.get("Reason", ""),
        restarts=int(kv.get("Restarts", "0") or 0),
        requeue=kv.get("Requeue", "1") == "1",
        node_list=kv.get("NodeList", ""),
        batch_flag=kv.get("BatchFlag", "1") == "1",
        time_limit=kv.get("TimeLimit", ""),
        end_time=kv.get("EndTime", ""),
        raw=kv,
    )


# What slurmagent reads from a job record; a job's free text (name, comment, paths) can imitate each.
JOB_KEYS = ("JobId", "JobState", "Reason", "Restarts", "Requeue", "NodeList", "BatchFlag", "TimeLimit", "EndTime")


def job_from_text(text: str, job_id: str) -> JobInfo | None:
    """Job `job_id` in a `scontrol -o show job` answer; None when the answer has no record.

    A job's name, comment, work dir and output paths are free text that may hold spaces,
    `Key=` tokens and newlines, and the name comes before the state: `JobName=x JobState=RUNNING`
    cannot be told from the real field by its text alone. So the answer is only believed when
    every field slurmagent reads appears exactly once per record and exactly one record is the
    job's; otherwise the JobInfo comes back with `ambiguous` naming those fields and their values
    blank (unknown), for the caller to ask a listing without free text (`Slurm.job` does)."""
    records = re.split(r"\n(?=JobId=)", text.strip("\n"))
    parsed = [_fields(r) for r in records if r.startswith("JobId=")]
    if not parsed:
        return None
    mine = [(kv, seen) for kv, seen in parsed if _is_job(kv, job_id)] or (parsed if len(parsed) == 1 else [])
    if len(mine) != 1:
        return JobInfo(job_id=job_id, state="", ambiguous=("JobId",))
    kv, seen = mine[0]
    present = {k for _, s in parsed for k in s if k in JOB_KEYS}
    ambiguous = tuple(k for k in JOB_KEYS if k in present and (
        seen.get(k, 0) != 1 or sum(s.get(k, 0) for _, s in parsed) != len(parsed)))
    if ambiguous:
        return JobInfo(job_id=job_id, state="", ambiguous=ambiguous)
    return job_from_kv(kv)


def _is_job(kv: dict[str, str], job_id: str) -> bool:
    return kv.get("JobId") == job_id or f"{kv.get('ArrayJobId')}_{kv.get('ArrayTaskId')}" == job_id


def script_execs_wrapper(script: str) -> bool:
    """Does a batch script exec the slurmagent wrapper (so USR1 means 'flush')?

    `exec [ENV=.. python -m] .../slurmagent[.entry|.cli] [--opts] run ...` on one line, before
    any `#` comment. One pass over the script's words (it is the user's text, up to Slurm's
    4 MB, read as root): no backtracking, linear time."""
    for line in script.split("\n"):
        words = line.split()
        if len(words) < 3 or words[0] != "exec":
            continue
        named = False
        for word in words[1:]:
            if word.startswith("#"):
                break
            if named and word == "run":
                return True
            if not named and "#" not in word and word.endswith(_WRAPPER_NAMES):
                named = True
    return False


_WRAPPER_NAMES = ("slurmagent", "slurmagent.entry", "slurmagent.cli")


@dataclass(frozen=True)
class RunningJob:
    """A job running on a node, from one squeue call: enough to requeue it exactly once.

    `restarts` is the job's restart count when it was seen: a later request for the same
    job with the same count is the same request (a job requeued since then has a higher one)."""

    job_id: str
    restarts: int = 0
    requeue: bool = True
    num_nodes: int = 1


RUNNING_JOB_FIELDS = ("JobID", "RestartCnt", "Requeue", "NumNodes")  # squeue -O, `|` after each


def running_jobs_from_text(text: str) -> list[RunningJob]:
    """`squeue -h -O JobID:|,RestartCnt:|,Requeue:|,NumNodes:|` lines, once each, in order."""
    jobs: dict[str, RunningJob] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < len(RUNNING_JOB_FIELDS) or not parts[0]:
            continue
        job_id, restarts, requeue, num_nodes = parts[: len(RUNNING_JOB_FIELDS)]
        jobs.setdefault(job_id, RunningJob(
            job_id=job_id,
            restarts=int(restarts) if restarts.isdigit() else 0,
            requeue=requeue not in ("0", "no", "false"),
            num_nodes=int(num_nodes) if num_nodes.isdigit() else 1,
        ))
    return list(jobs.values())


@dataclass(frozen=True)
class JobOwner:
    """The job as root read it from Slurm (squeue's numeric fields: no free text)."""
    job: str
    uid: int
    state: str
    nodes: tuple[str, ...]
    run_s: float | None = None  # how long this attempt has run (squeue %M); None when not said
    own_id: str = ""  # its own numeric id (squeue %A): an array task's too, as its cgroup and SLURM_JOB_ID say


def elapsed_seconds(text: str) -> float | None:
    """squeue's `%M` ("SS", "M:SS", "H:MM:SS", "D-HH:MM:SS") in seconds; None when it is not one."""
    days, _, clock = text.strip().rpartition("-")
    fields = clock.split(":")
    if not days.isdigit() and days or not 1 <= len(fields) <= 3 or not all(f.isdigit() and len(f) <= 9 for f in fields):
        return None
    seconds = 0
    for f in fields:
        seconds = seconds * 60 + int(f)
    return float(seconds + 86400 * int(days or 0))


def owner_from_squeue(line: str) -> JobOwner | None:
    """One `squeue -h -o %i|%U|%T|%N|%M|%A` line (numeric uid, state, node list, time used, own
    numeric id: no job text)."""
    parts = line.strip().split("|")
    if len(parts) not in (4, 5, 6) or not parts[1].isdigit():
        return None
    job, uid, state, nodes = parts[:4]
    try:
        names = tuple(hostlist.expand(nodes)) if nodes and nodes != "(null)" else ()
    except ValueError:
        names = ()
    own = parts[5] if len(parts) == 6 and parts[5].isdigit() else ""
    return JobOwner(job, int(uid), state, names, elapsed_seconds(parts[4]) if len(parts) >= 5 else None, own)
