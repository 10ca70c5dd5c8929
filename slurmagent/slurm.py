"""The Slurm seam: scontrol/sbatch as argv lists with deadlines, named by intent.

Node state is a set of flags with small pure predicates (aws-parallelcluster style); every
call that takes nodes takes a list and sends one hostlist, so mass events stay cheap.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from . import hostlist
from .errors import SlurmError
from .policy import PREFIX as REASON_PREFIX, DrainFlags

MAX_REASON = 200


class Runner(Protocol):
    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess: ...


def run_argv(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run one command as an argv list (never a shell) with a deadline."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{os.path.basename(argv[0])} {argv[1] if len(argv) > 1 else ''} timed out after {timeout:g} s") from None
    except OSError as exc:
        raise SlurmError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None


# What slurmagent accepts as a node name (Slurm's own names are letters, digits, `-`, `_`, `.`):
# no hostlist syntax (`,` `[`), no path syntax (`/`, a leading `.`), no spaces or `=`, so a
# name can neither widen an scontrol update to other nodes nor leave the state dir.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
JOB_ID = re.compile(r"[0-9]{1,20}(_[0-9]{1,10})?")  # a job id, or ARRAYJOBID_TASKID


def valid_node_name(name: str | None) -> bool:
    return bool(name) and NODE_NAME.fullmatch(name) is not None


def clean_reason(text: str) -> str:
    """A drain reason that reads well in `sinfo -R` and cannot smuggle anything into scontrol."""
    text = re.sub(r"[^A-Za-z0-9 _.,:;/()@+#%-]", " ", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text[:MAX_REASON]


def make_reason(rule: str, detail: str) -> str:
    return clean_reason(f"{REASON_PREFIX} {rule}: {detail}" if detail else f"{REASON_PREFIX} {rule}")


@dataclass(frozen=True)
class NodeInfo(DrainFlags):
    name: str
    flags: frozenset[str]
    reason: str = ""
    gres: str = ""
    partitions: str = ""

    @property
    def drained_by_slurmagent(self) -> bool:
        return self.ours

    @property
    def drained_by_other(self) -> bool:
        """Drained by an admin or by Slurm itself: slurmagent never touches those."""
        return self.held_by_other


@dataclass(frozen=True)
class JobInfo:
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

    @property
    def held(self) -> bool:
        return self.state == "PENDING" and (
            self.reason in ("JobHeldAdmin", "JobHeldUser") or "held" in self.reason.lower()
        )


def parse_kv(line: str) -> dict[str, str]:
    """`scontrol -o` output: Key=Value tokens; Reason/Comment values may contain spaces."""
    out: dict[str, str] = {}
    key = None
    for token in line.strip().split(" "):
        name, eq, value = token.partition("=")
        if eq and re.fullmatch(r"[A-Za-z][A-Za-z0-9_:/]*", name):
            key = name
            out[key] = value
        elif key is not None:
            out[key] += " " + token
    # scontrol pads some fields with a second space (`Partitions=gpu  BootTime=...`).
    return {k: v.rstrip(" ") for k, v in out.items()}


def node_from_kv(kv: dict[str, str]) -> NodeInfo:
    flags = frozenset(f for f in re.split(r"[+*]", kv.get("State", "")) if f)
    reason = kv.get("Reason", "")
    reason = re.sub(r" \[[^\]]*@[^\]]*\]$", "", reason)  # drop scontrol's "[user@time]" suffix
    if reason == "(null)":
        reason = ""
    return NodeInfo(
        name=kv.get("NodeName", ""),
        flags=flags,
        reason=reason,
        gres=kv.get("Gres", ""),
        partitions=kv.get("Partitions", ""),
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


class Slurm:
    """scontrol wrapped in intent-named, batched calls with named deadlines."""

    def __init__(self, scontrol: str = "scontrol", timeout_s: float = 10.0, runner: Runner = run_argv,
                 sbatch: str = "sbatch"):
        self.scontrol = scontrol
        self.sbatch_bin = sbatch
        self.timeout_s = timeout_s
        self.runner = runner
        self.calls = 0

    @classmethod
    def from_config(cls, cfg) -> Slurm:
        if cfg.slurm.conf:
            os.environ.setdefault("SLURM_CONF", cfg.slurm.conf)
        return cls(cfg.slurm.scontrol, cfg.slurm.timeout_s, sbatch=cfg.slurm.sbatch)

    def _scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        self.calls += 1
        proc = self.runner([self.scontrol, *args], self.timeout_s)
        if check and proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise SlurmError(f"scontrol {args[0]} {args[1] if len(args) > 1 else ''}: {msg[-1] if msg else 'failed'}")
        return proc

    # --- reads --------------------------------------------------------------------------

    def nodes(self, names: list[str] | None = None) -> list[NodeInfo]:
        args = ["-o", "show", "node"] + ([hostlist.compress(names)] if names else [])
        out = self._scontrol(*args).stdout
        return [node_from_kv(parse_kv(line)) for line in out.splitlines() if line.startswith("NodeName=")]

    def node(self, name: str) -> NodeInfo:
        found = self.nodes([name])
        if not found:
            raise SlurmError(f"scontrol show node {name}: no such node")
        return found[0]

    def job(self, job_id: str) -> JobInfo | None:
        proc = self._scontrol("-o", "show", "job", job_id, check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            raise SlurmError(f"scontrol show job {job_id}: {proc.stderr.strip() or 'failed'}")
        lines = [line for line in proc.stdout.splitlines() if line.startswith("JobId=")]
        return job_from_kv(parse_kv(lines[0])) if lines else None

    # --- actions ------------------------------------------------------------------------

    def drain(self, nodes: list[str], reason: str) -> None:
        if nodes:
            self._scontrol("update", f"NodeName={hostlist.compress(nodes)}", "State=DRAIN", f"Reason={clean_reason(reason)}")

    def set_reason(self, nodes: list[str], reason: str) -> None:
        if nodes:
            self._scontrol("update", f"NodeName={hostlist.compress(nodes)}", f"Reason={clean_reason(reason)}")

    def resume(self, nodes: list[str]) -> None:
        if nodes:
            self._scontrol("update", f"NodeName={hostlist.compress(nodes)}", "State=RESUME")

    def requeue(self, job_ids: list[str]) -> None:
        if job_ids:
            self._scontrol("requeue", ",".join(job_ids))

    def release(self, job_ids: list[str]) -> None:
        if job_ids:
            self._scontrol("release", ",".join(job_ids))

    def sbatch(self, args: list[str]) -> subprocess.CompletedProcess:
        self.calls += 1
        return self.runner([self.sbatch_bin, *args], self.timeout_s)


# --- slurm.conf / gres.conf, read locally (the healthy path makes no slurmctld round trip) ---


def slurm_conf_path(configured: str = "") -> Path:
    return Path(configured or os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")


def read_conf_lines(path: Path, _depth: int = 0) -> list[str]:
    """slurm.conf-style lines with comments and continuations removed, Includes followed."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    text = text.replace("\\\n", " ")
    lines = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"(?i)include\s+(\S+)", line)
        if m and _depth < 5:
            inc = Path(m[1]) if m[1].startswith("/") else path.parent / m[1]
            lines.extend(read_conf_lines(inc, _depth + 1))
            continue
        lines.append(line)
    return lines


def _conf_items(line: str) -> dict[str, str]:
    items = {}
    for token in line.split():
        key, eq, value = token.partition("=")
        if eq:
            items[key.lower()] = value
    return items


def conf_value(lines: list[str], key: str) -> str | None:
    value = None
    for line in lines:
        items = _conf_items(line)
        if key.lower() in items and "nodename" not in items and "partitionname" not in items:
            value = items[key.lower()]
    return value


def gpu_count_from_gres(gres: str) -> int | None:
    """`gpu:8`, `gpu:h100:8`, `gpu:h100:8(S:0-1),shard:4` -> 8; None when no gpu gres."""
    total = None
    for item in re.split(r",(?![^()]*\))", gres):
        item = re.sub(r"\(.*\)", "", item.strip())
        parts = item.split(":")
        if parts[0] != "gpu":
            continue
        count = parts[-1] if len(parts) > 1 and parts[-1].isdigit() else "1"
        total = (total or 0) + int(count)
    return total


def expected_gpus_for(node: str, conf: Path) -> int | None:
    """The node's GPU count from gres.conf (Count= or File=) or else its `Gres=` in slurm.conf."""
    lines = read_conf_lines(conf)
    gres_conf = conf.parent / "gres.conf"
    total = None
    for line in read_conf_lines(gres_conf):
        items = _conf_items(line)
        if items.get("name") != "gpu" and not items.get("autodetect"):
            continue
        if "nodename" in items and node not in hostlist.expand(items["nodename"]):
            continue
        if "count" in items and items["count"].isdigit():
            total = (total or 0) + int(items["count"])
        elif "file" in items:
            total = (total or 0) + len(hostlist.expand(items["file"]))
    if total is not None:
        return total
    default_gres = None  # `NodeName=DEFAULT Gres=...` applies to the node lines after it
    for line in lines:
        items = _conf_items(line)
        if "nodename" not in items:
            continue
        if items["nodename"].upper() == "DEFAULT":
            default_gres = items.get("gres", default_gres)
            continue
        gres = items.get("gres", default_gres)
        if gres is not None and node in _expand_safe(items["nodename"]):
            return gpu_count_from_gres(gres)
    return None


def _expand_safe(expr: str) -> list[str]:
    try:
        return hostlist.expand(expr)
    except ValueError:
        return []
