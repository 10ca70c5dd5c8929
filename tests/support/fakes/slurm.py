"""ONE in-memory Slurm for unit tests: scontrol, squeue, scancel and sbatch as a `Slurm` runner.

`FakeSlurm` keeps nodes, jobs, batch scripts and partitions, answers the argv lists
slurmagent sends the way the real commands print (`scontrol -o`), changes its state on
`update`/`requeue`/`release`, and records every call. It can play a dead slurmctld (`down`),
a failing command or verb (`fail`), a hung one (`hang`: the runner raises the timeout), or
answer from canned replies first (`replies`, for parser tests).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from typing import Any

from slurmagent.core import hostlist
from slurmagent.errors import SlurmError

UNREACHABLE = "Unable to contact slurm controller (connect failure)"
_STAMPED = re.compile(r" \[[^\]]*@[^\]]*\]$")
_NODE_KEYS = ("State", "Reason", "Comment", "Gres", "Partitions", "ReasonTime")  # the rest is printed as is


class FakeSlurm:
    def __init__(self, nodes: tuple[str, ...] | list[str] = ("n1",), *, state: str = "IDLE", reason: str = "",
                 gres: str = "gpu:8", partition: str = "gpu", max_time: str = "UNLIMITED", stamp: str | None = None,
                 resume_keeps_reason: bool = False):
        self.nodes: dict[str, dict[str, str]] = {
            n: {"State": state, "Reason": reason, "Comment": "", "Gres": gres, "Partitions": partition} for n in nodes}
        self.jobs: dict[str, dict[str, str]] = {}  # job id -> scontrol fields (JobState, Reason, TimeLimit, ...)
        self.scripts: dict[str, str] = {}  # job id -> batch script ("" = none)
        self.partitions = {partition: max_time}
        self.stamp = stamp  # the `[root@TIME]` of reasons; None: the time they were set
        self.resume_keeps_reason = resume_keeps_reason  # Slurm 24.11 keeps a resumed node's Reason (22.05 clears it)
        self.down = False  # slurmctld unreachable: every command fails
        self.fail: set[str] = set()  # commands ("squeue") or scontrol verbs ("show", "update") that fail
        self.hang: set[str] = set()  # ... that time out (the runner raises, like run_argv)
        self.replies: list[Any] = []  # canned (code, stdout, stderr) or exceptions, answered first
        self.sbatch_reply = "100\n"
        self.config = {"SLURM_VERSION": "22.05.8", "SlurmctldParameters": "(null)", "SlurmctldPort": "6817"}
        self.calls: list[list[str]] = []
        self.timeouts: list[float] = []

    @classmethod
    def cluster(cls, n: int = 8, **kw: Any) -> FakeSlurm:
        return cls([f"n{i}" for i in range(1, n + 1)], **kw)

    # --- the first node, for one-node tests --------------------------------------------------

    @property
    def first(self) -> dict[str, str]:
        return next(iter(self.nodes.values()))

    @property
    def state(self) -> str:
        return self.first["State"]

    @state.setter
    def state(self, value: str) -> None:
        self.first["State"] = value

    @property
    def reason(self) -> str:
        return self.first["Reason"]

    @reason.setter
    def reason(self, value: str) -> None:
        self.first["Reason"] = value

    def add_job(self, job_id: str, state: str = "RUNNING", node: str = "n1", script: str | None = None,
                **fields: str) -> None:
        self.jobs[job_id] = {"JobState": state, "Reason": "None", "Restarts": "0", "Requeue": "1", "NodeList": node,
                             "BatchFlag": "1", "TimeLimit": "01:00:00", **fields}
        if script is not None:
            self.scripts[job_id] = script

    # --- what the tests look at ---------------------------------------------------------------

    @property
    def argvs(self) -> list[list[str]]:
        return self.calls

    def of(self, tool: str, *prefix: str) -> list[list[str]]:
        return [a for a in self.calls if os.path.basename(a[0]) == tool and a[1:1 + len(prefix)] == list(prefix)]

    def verbs(self) -> list[str]:
        return [_verb(a) for a in self.calls]

    def updates(self) -> list[list[str]]:
        return [a for a in self.calls if _verb(a) == "update"]

    @property
    def drains(self) -> list[list[str]]:
        return [a for a in self.updates() if "State=DRAIN" in a]

    # --- the runner -----------------------------------------------------------------------------

    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), argv
        assert timeout > 0
        self.calls.append(list(argv))
        self.timeouts.append(timeout)
        if self.replies:
            reply = self.replies.pop(0)
            if isinstance(reply, BaseException):
                raise reply
            return subprocess.CompletedProcess(argv, *reply)
        tool, verb = os.path.basename(argv[0]), _verb(argv)
        if tool in self.hang or verb in self.hang:
            raise SlurmError(f"{tool} {verb} timed out after {timeout:g} s")
        if self.down or tool in self.fail or verb in self.fail:
            return _answer(argv, 1, err=f"{tool}: error: {UNREACHABLE}\n")
        handler = getattr(self, f"_{tool}", None)
        if handler is None:
            raise AssertionError(f"unexpected command {argv}")
        return handler(argv, argv[1:])

    def _scontrol(self, argv: list[str], args: list[str]) -> subprocess.CompletedProcess:
        if args[:3] == ["-o", "show", "node"]:
            names = hostlist.expand(args[3]) if len(args) > 3 else list(self.nodes)
            missing = [n for n in names if n not in self.nodes]
            if missing:
                return _answer(argv, 1, err=f"Node {missing[0]} not found\n")
            return _answer(argv, 0, "".join(self._node_line(n) for n in names))
        if args[:3] == ["-o", "show", "job"]:
            job = self.jobs.get(args[3])
            if job is None:
                return _answer(argv, 1, err="slurm_load_jobs error: Invalid job id specified\n")
            return _answer(argv, 0, f"JobId={args[3]} " + " ".join(f"{k}={v}" for k, v in job.items()) + "\n")
        if args[:3] == ["-o", "show", "partition"]:
            return _answer(argv, 0, "".join(f"PartitionName={p} MaxTime={t} Nodes={','.join(self.nodes)}\n"
                                            for p, t in self.partitions.items()))
        if args[:2] == ["show", "config"]:  # the controller's running config, as `scontrol show config` prints it
            return _answer(argv, 0, "Configuration data as of 2026-12-01T00:00:00\n"
                           + "".join(f"{k:<24}= {v}\n" for k, v in self.config.items()))
        if args[:2] == ["write", "batch_script"]:
            script = self.scripts.get(args[2], "")
            return _answer(argv, 0, script) if script else _answer(argv, 1, err="scontrol: error: Job has no batch script\n")
        if args[0] == "update":
            fields = dict(a.split("=", 1) for a in args[1:])
            names = hostlist.expand(fields.pop("NodeName"))
            if any(n not in self.nodes for n in names):
                return _answer(argv, 1, err="slurm_update error: Invalid node name specified\n")
            for name in names:
                self._update_node(self.nodes[name], fields)
            return _answer(argv, 0)
        if args[0] in ("requeue", "release"):
            ids = args[1].split(",")
            if any(j not in self.jobs for j in ids):
                return _answer(argv, 1, err="Invalid job id specified\n")
            for jid in ids:
                job = self.jobs[jid]
                if args[0] == "requeue" and job.get("Requeue") == "0":
                    return _answer(argv, 1, err=f"Requeue of JobId={jid} failed: Job is not requeueable\n")
                if args[0] == "requeue" and job["JobState"] in ("PENDING", "REQUEUED"):
                    return _answer(argv, 1, err=f"Job is pending execution for job {jid}\n")  # as Slurm says
                requeue = args[0] == "requeue"
                job.update(JobState="PENDING", Reason="BeginTime" if requeue else "None",
                           Restarts=str(int(job.get("Restarts", "0")) + requeue))
            return _answer(argv, 0)
        raise AssertionError(f"unexpected scontrol call {argv}")

    def _squeue(self, argv: list[str], args: list[str]) -> subprocess.CompletedProcess:
        if "-j" in args:  # `-h -j JOB -o %i|%U|%T|%N|%M|%A`: the job's owner (numeric uid: field `Uid`), state, nodes, run time
            job = args[args.index("-j") + 1]
            f = self.jobs.get(job)
            if f is None:
                return _answer(argv, 1, err="slurm_load_jobs error: Invalid job id specified")
            line = f"{job}|{f.get('Uid', '0')}|{f['JobState']}|{f['NodeList']}"
            fmt = args[args.index("-o") + 1]
            line += f"|{f.get('RunTime', '1:00:00')}" if "|%M" in fmt else ""
            line += f"|{f.get('JobIdRaw', job.split('_')[0])}" if fmt.endswith("|%A") else ""
            return _answer(argv, 0, line + "\n")
        node = args[args.index("-w") + 1]
        states = args[args.index("-t") + 1].split(",")
        ids = [j for j, f in self.jobs.items() if f["JobState"] in states and node in hostlist.expand(f["NodeList"])]
        if "-O" in args:  # JobID:|,RestartCnt:|,Requeue:|,NumNodes:|
            fields = {"JobID": lambda j, f: j, "RestartCnt": lambda j, f: f.get("Restarts", "0"),
                      "Requeue": lambda j, f: f.get("Requeue", "1"),
                      "NumNodes": lambda j, f: str(len(hostlist.expand(f["NodeList"])))}
            names = [spec.split(":")[0] for spec in args[args.index("-O") + 1].split(",")]
            return _answer(argv, 0, "".join("".join(f"{fields[n](j, self.jobs[j])}|" for n in names) + "\n"
                                            for j in ids))
        return _answer(argv, 0, "".join(f"{j}\n" for j in ids))

    def _scancel(self, argv: list[str], args: list[str]) -> subprocess.CompletedProcess:
        if not any(a.startswith("--signal") for a in args):  # a plain scancel ends the jobs
            for jid in args:
                if jid in self.jobs:
                    self.jobs[jid].update(JobState="CANCELLED", Reason="None")
        return _answer(argv, 0)

    def _sbatch(self, argv: list[str], args: list[str]) -> subprocess.CompletedProcess:
        return _answer(argv, 0, self.sbatch_reply)

    def _node_line(self, name: str) -> str:
        n = self.nodes[name]
        reason = n["Reason"]
        if reason and not _STAMPED.search(reason):
            reason += f" [root@{self.stamp or n.get('ReasonTime') or time.strftime('%Y-%m-%dT%H:%M:%S')}]"
        extra = "".join(f" {k}={v}" for k, v in n.items() if k not in _NODE_KEYS)  # AvailableFeatures, ...
        line = (f"NodeName={name} Arch=x86_64 CPUTot=2 State={n['State']} Gres={n['Gres']} "
                f"Partitions={n['Partitions']}{extra} Reason={reason or '(null)'}")
        return line + (f" Comment={n['Comment']}" if n["Comment"] else "") + "\n"

    def _update_node(self, n: dict[str, str], fields: dict[str, str]) -> None:
        base, *flags = n["State"].split("+")
        if fields.get("State") == "DRAIN":
            n["State"] = "+".join([base, *[f for f in flags if f != "DRAIN"], "DRAIN"])
        elif fields.get("State") == "RESUME":
            # Slurm: drain and DOWN cleared; power-saving flags (CLOUD, POWERED_DOWN) stay
            kept = [f for f in flags if f in ("CLOUD", "POWERED_DOWN")]
            n["State"] = "+".join(["IDLE" if base == "DOWN" else base, *kept])
            if not self.resume_keeps_reason:
                n["Reason"] = ""
        elif fields.get("State") in ("POWER_DOWN_ASAP", "POWER_DOWN_FORCE", "POWER_DOWN"):
            # Slurm 22.05 on an idle node: the drain goes, the node powers down (SuspendProgram)
            kept = [f for f in flags if f not in ("DRAIN", "NOT_RESPONDING", "POWERING_UP")]
            n["State"] = "+".join([base, *kept, "POWERED_DOWN"])
        if "Reason" in fields:
            n["Reason"], n["ReasonTime"] = fields["Reason"], time.strftime("%Y-%m-%dT%H:%M:%S")
        if "Comment" in fields:
            n["Comment"] = fields["Comment"]


def _verb(argv: list[str]) -> str:
    """`show` for `scontrol -o show ...`, the first argument otherwise (the command for others)."""
    tool = os.path.basename(argv[0])
    if tool != "scontrol":
        return tool
    return "show" if argv[1:3] == ["-o", "show"] else argv[1]


def _answer(argv: list[str], code: int, out: str = "", err: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(argv, code, out, err)
