"""The Slurm seam: every scontrol/squeue/scancel/sbatch argv, with deadlines, named by intent.

Each binary has its own configurable path (`[slurm] scontrol`, `squeue`, `scancel`,
`sbatch`); every call that takes nodes or jobs takes a list and sends one hostlist (or one
comma list), so mass events stay cheap. What comes back is parsed by `slurm/model.py` (ONE model).
Changing Slurm state is the business of `actions/` (the `JournalExecutor`): it calls the writes below.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, TypeVar

from ..core import hostlist
from ..errors import SlurmError
from . import env as slurm_env
from ..core.reasons import clean_reason
from ..core.timefmt import parse_time_limit

if TYPE_CHECKING:
    import subprocess

    from .model import JobInfo, JobOwner, NodeInfo, RunningJob

# The healthy prolog imports this module for its names and slurm.conf readers only: `subprocess`
# and `model` (the parsers of scontrol's answers) are imported by the calls that need them.

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 10.0  # one scontrol/squeue/scancel/sbatch call, unless [slurm] timeout_s says otherwise


class Runner(Protocol):
    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess: ...


def run_argv(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run one command as an argv list (never a shell) with a deadline (in `env` when given)."""
    import subprocess  # only when a command runs: start-up speed of the healthy prolog

    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)
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


def unreachable(exc: BaseException) -> bool:
    """slurmctld (or the Slurm command itself) cannot be reached: stop, retry later."""
    text = str(exc).lower()
    return any(s in text for s in ("unable to contact", "timed out", "connect failure", "connection refused",
                                   "cannot run", "socket timed out", "zero bytes"))


# scontrol's answers to a requeue that no retry can change (the job is not requeueable, gone,
# not a batch job, not ours); any other failure (controller unreachable, "Unexpected message
# received" from a restarting one, a timeout) may pass. "Job is pending execution" means it was
# requeued already: `requeue_already_done`.
REQUEUE_REFUSALS = ("presently disabled", "invalid job id", "permission denied", "access denied",
                    "only batch jobs", "not supported", "invalid state specification")


def requeue_refused_for_good(exc: BaseException) -> bool:
    """A requeue failure that retrying cannot change (classified by scontrol's message)."""
    text = str(exc).lower()
    return any(s in text for s in REQUEUE_REFUSALS) or requeue_already_done(exc)


def requeue_already_done(exc: BaseException) -> bool:
    """scontrol refused the requeue because the job is already PENDING again."""
    return "pending execution" in str(exc).lower()


def retry_with_backoff(call: Callable[[], T], deadline: float, permanent: Callable[[Exception], bool],
                       say: Callable[[str], None], *, what: str = "the call", clock: Callable[[], float] = time.monotonic,
                       sleep: Callable[[float], None] = time.sleep, first_wait_s: float = 1.0,
                       max_wait_s: float = 8.0) -> T:
    """`call()` until it works, fails for good (`permanent`), or the clock passes `deadline`
    (slurmctld restarting or failing over must not cost a requeue): waits double from
    `first_wait_s` up to `max_wait_s`, never past the deadline, and one line says each wait.
    The last failure is raised."""
    wait, tries = first_wait_s, 0
    while True:
        tries += 1
        try:
            return call()
        except SlurmError as exc:
            if permanent(exc):
                raise
            left = deadline - clock()
            if left <= 0:
                raise SlurmError(f"{exc} (gave up after {tries} tries: no time left)") from None
            pause = min(wait, max_wait_s, left)
            say(f"{what} failed ({exc}); try {tries + 1} in {pause:.1f} s ({left:.0f} s left)")
            sleep(pause)
            wait *= 2


class Slurm:
    """Slurm's commands wrapped in intent-named, batched calls with named deadlines."""

    def __init__(self, scontrol: str = "scontrol", timeout_s: float = DEFAULT_TIMEOUT_S, runner: Runner = run_argv,
                 sbatch: str = "sbatch", squeue: str = "squeue", scancel: str = "scancel"):
        self.scontrol = scontrol
        self.sbatch_bin = sbatch
        self.squeue = squeue
        self.scancel = scancel
        self.timeout_s = timeout_s
        self.runner = runner
        self.calls = 0

    @classmethod
    def from_config(cls, cfg) -> Slurm:
        if cfg.slurm.conf:
            os.environ.setdefault(slurm_env.CONF, cfg.slurm.conf)
        s = cfg.slurm
        return cls(s.scontrol, s.timeout_s, sbatch=s.sbatch, squeue=s.squeue, scancel=s.scancel)

    def _call(self, binary: str, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        self.calls += 1
        proc = self.runner([binary, *args], self.timeout_s)
        if check and proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise SlurmError(f"{os.path.basename(binary)} {args[0]} {args[1] if len(args) > 1 else ''}: "
                             f"{msg[-1] if msg else 'failed'}")
        return proc

    def _scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._call(self.scontrol, list(args), check)

    # --- reads --------------------------------------------------------------------------

    def nodes(self, names: list[str] | None = None) -> list[NodeInfo]:
        """All nodes (one call), or those named (one hostlist)."""
        from .model import nodes_from_text  # scontrol's parsers off the healthy prolog: start-up speed

        args = ["-o", "show", "node"] + ([hostlist.compress(names)] if names else [])
        return nodes_from_text(self._scontrol(*args).stdout)

    def node(self, name: str) -> NodeInfo:
        found = self.nodes([name])
        if not found:
            raise SlurmError(f"scontrol show node {name}: no such node")
        return found[0]

    def job(self, job_id: str) -> JobInfo | None:
        from .model import job_from_text  # scontrol's parsers off the healthy prolog: start-up speed

        proc = self._scontrol("-o", "show", "job", job_id, check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            raise SlurmError(f"scontrol show job {job_id}: {proc.stderr.strip() or 'failed'}")
        job = job_from_text(proc.stdout, job_id)
        if job is not None and job.ambiguous:
            return self._job_without_free_text(job)
        return job

    # squeue's fields that hold no text a job chose; Reason (it may hold spaces) last
    _SQUEUE_JOB_FIELDS = "JobID:0|,State:0|,RestartCnt:0|,Requeue:0|,BatchFlag:0|,TimeLimit:0|,EndTime:0|,NodeList:0|,Reason:0"

    def _job_without_free_text(self, job: JobInfo) -> JobInfo:
        """The fields of a job whose own text imitates scontrol's (see `job_from_text`), from a
        squeue listing that prints none of its free text; the unknown JobInfo when that fails."""
        from .model import JobInfo  # scontrol's parsers off the healthy prolog: start-up speed

        try:
            proc = self._call(self.squeue, ["-h", "-j", job.job_id, "-t", "all", "-O", self._SQUEUE_JOB_FIELDS],
                              check=False)
        except SlurmError:
            return job
        lines = proc.stdout.splitlines() if proc.returncode == 0 else []
        parts = lines[0].split("|", 8) if len(lines) == 1 else []
        if len(parts) != 9 or not parts[2].isdigit():
            return job
        _, state, restarts, requeue, batch, limit, end, nodes, reason = parts
        return JobInfo(job_id=job.job_id, state=state, reason=reason.strip(), restarts=int(restarts),
                       requeue=requeue == "1", node_list=nodes, batch_flag=batch == "1", time_limit=limit,
                       end_time=end, raw={})

    def jobs_on_node(self, node: str, states: tuple[str, ...] = ("RUNNING",)) -> list[str]:
        """Ids of the jobs in these states on the node (`squeue -h -w NODE -t ... -o %A`), in order, once each."""
        proc = self._call(self.squeue, ["-h", "-w", node, "-t", ",".join(states), "-o", "%A"])
        return list(dict.fromkeys(proc.stdout.split()))

    def running_jobs(self, node: str) -> list[RunningJob]:
        """The jobs running on the node with their restart count, requeue flag and node count, in
        one call (`squeue -h -w NODE -t RUNNING -O JobID:|,RestartCnt:|,Requeue:|,NumNodes:|`)."""
        from .model import RUNNING_JOB_FIELDS, running_jobs_from_text  # off the healthy prolog: start-up speed

        fmt = ",".join(f"{f}:|" for f in RUNNING_JOB_FIELDS)
        proc = self._call(self.squeue, ["-h", "-w", node, "-t", "RUNNING", "-O", fmt])
        return running_jobs_from_text(proc.stdout)

    def job_owner(self, job_id: str) -> JobOwner | None:
        """Who runs the job, in what state, where, how long: `squeue -h -j JOB -o %i|%U|%T|%N|%M|%A` (numeric uid;
        no field a job's own text could imitate). None when Slurm does not know the job."""
        from .model import owner_from_squeue  # off the healthy prolog: start-up speed

        proc = self._call(self.squeue, ["-h", "-j", job_id, "-o", "%i|%U|%T|%N|%M|%A"], check=False)
        if proc.returncode != 0:
            if "Invalid job id" in (proc.stderr or ""):
                return None
            raise SlurmError(f"squeue -j {job_id}: {(proc.stderr or 'failed').strip()}")
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        return owner_from_squeue(lines[0]) if len(lines) == 1 else None

    def job_is_wrapped(self, job_id: str) -> bool:
        """Does the job's batch script exec the slurmagent wrapper (so a signal to its batch step
        means 'flush')? One `scontrol write batch_script` call."""
        from .model import script_execs_wrapper  # off the healthy prolog: start-up speed

        script = self.job_script(job_id)
        return script is not None and script_execs_wrapper(script)

    def job_script(self, job_id: str) -> str | None:
        """The job's batch script (`scontrol write batch_script JOB -`); None when there is none."""
        proc = self._scontrol("write", "batch_script", job_id, "-", check=False)
        return proc.stdout if proc.returncode == 0 else None

    def partition_max_times(self, names: list[str]) -> list[float | None]:
        """MaxTime of each named partition that exists, in seconds (None = unlimited); one call."""
        from .model import parse_kv  # scontrol's parsers off the healthy prolog: start-up speed

        out = self._scontrol("-o", "show", "partition").stdout
        limits = []
        for line in out.splitlines():
            kv = parse_kv(line)
            if kv.get("PartitionName") in names:
                limits.append(parse_time_limit(kv.get("MaxTime", "UNLIMITED")))
        return limits

    # --- writes (the actions' executor calls these) --------------------------------------------------

    def update_nodes(self, nodes: list[str], **fields: str) -> None:
        """`scontrol update NodeName=<hostlist> K=V ...` in one call; a Reason is cleaned."""
        if not nodes:
            return
        args = ["update", f"NodeName={hostlist.compress(nodes)}"]
        for key, value in fields.items():
            args.append(f"{key}={clean_reason(value) if key == 'Reason' else value}")
        self._scontrol(*args)

    def drain(self, nodes: list[str], reason: str) -> None:
        self.update_nodes(nodes, State="DRAIN", Reason=reason)

    def set_reason(self, nodes: list[str], reason: str) -> None:
        self.update_nodes(nodes, Reason=reason)

    def set_reasons(self, reasons: dict[str, str], **extra: str) -> int:
        """Set each node's reason, one call per distinct reason. Returns the calls made."""
        groups: dict[str, list[str]] = {}
        for node, reason in reasons.items():
            groups.setdefault(reason, []).append(node)
        for reason, nodes in groups.items():
            self.update_nodes(nodes, Reason=reason, **extra)
        return len(groups)

    def resume(self, nodes: list[str]) -> None:
        self.update_nodes(nodes, State="RESUME")

    def requeue(self, job_ids: list[str], *, hold: bool = False, special_exit: bool = False) -> None:
        """`scontrol requeue JOBS` in one call; `hold`: `requeuehold [State=SpecialExit] JOBS`."""
        if job_ids:
            verb = ["requeuehold", *(["State=SpecialExit"] if special_exit else [])] if hold else ["requeue"]
            self._scontrol(*verb, ",".join(job_ids))

    def excluded_nodes(self, job_id: str) -> list[str]:
        """The nodes job `job_id` excludes (its ExcNodeList: `squeue -o %x`, one call). Read it while
        the job runs: after a requeue from inside the job, Slurm's SIGTERM to the job's processes
        may end this very call."""
        if not JOB_ID.fullmatch(job_id):
            raise SlurmError(f"not a job id: {job_id!r}")
        listed = self._call(self.squeue, ["-h", "-j", job_id, "-t", "all", "-o", "%x"]).stdout.strip()
        return hostlist.expand(listed) if listed and listed not in ("(null)", "N/A") else []

    def exclude_nodes(self, job_id: str, nodes: list[str], keep: list[str] = ()) -> list[str]:
        """Keep a PENDING job off `nodes` from now on: its ExcNodeList becomes `keep` (what it excluded
        already, `excluded_nodes`) and `nodes`, one call. Slurm (22.05) refuses the update while the
        job runs ("Job is no longer pending execution"): requeue it first. Returns the list set."""
        if not JOB_ID.fullmatch(job_id) or not nodes or not all(valid_node_name(n) for n in (*nodes, *keep)):
            raise SlurmError(f"cannot exclude {nodes!r} from job {job_id!r}: not a job id and node names")
        want = sorted(set(keep) | set(nodes))
        self._scontrol("update", f"JobId={job_id}", f"ExcNodeList={hostlist.compress(want)}")
        return want

    def cancel(self, job_ids: list[str]) -> None:
        """`scancel JOB...` in one call."""
        if job_ids:
            self._call(self.scancel, list(job_ids))

    def release(self, job_ids: list[str]) -> None:
        if job_ids:
            self._scontrol("release", ",".join(job_ids))

    def signal_jobs(self, job_ids: list[str], signal: str, batch: bool = True) -> None:
        """`scancel [--batch] --signal=SIG JOB...` in one call (batch: the batch step only)."""
        if job_ids:
            self._call(self.scancel, [*(["--batch"] if batch else []), f"--signal={signal}", *job_ids])

    def sbatch(self, args: list[str]) -> subprocess.CompletedProcess:
        self.calls += 1
        return self.runner([self.sbatch_bin, *args], self.timeout_s)

    def show_config(self, timeout_s: float | None = None) -> dict[str, str]:
        """The controller's running config (`scontrol show config`), key -> value (`features.py`)."""
        from .features import parse_show_config  # start-up speed: only where a caller asks what Slurm offers

        self.calls += 1
        proc = self.runner([self.scontrol, "show", "config"], timeout_s or self.timeout_s)
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise SlurmError(f"scontrol show config: {msg[-1] if msg else 'failed'}")
        return parse_show_config(proc.stdout)


# --- slurm.conf / gres.conf, read locally (the healthy path makes no slurmctld round trip) ---


def slurm_conf_path(configured: str = "") -> Path:
    return Path(configured or slurm_env.conf(os.environ) or "/etc/slurm/slurm.conf")


# Where slurm.conf is looked for after `[slurm] conf` and $SLURM_CONF (which only slurmd's own
# children, the prolog and epilog, get on a configless node): the configless cache where Slurm
# links it, the cache in the default SlurmdSpoolDir, then the classic path. Data, so tests
# point it at a temporary tree.
CONF_SEARCH: tuple[Path, ...] = (
    Path("/run/slurm/conf/slurm.conf"),
    Path("/var/spool/slurmd/conf-cache/slurm.conf"),
    Path("/etc/slurm/slurm.conf"),
)


def conf_candidates(configured: str = "", env: Mapping[str, str] = os.environ,
                    search: tuple[Path, ...] = CONF_SEARCH) -> list[Path]:
    """Every slurm.conf to try, in order, each once."""
    out: list[Path] = []
    for p in (configured, slurm_env.conf(env), *search):
        if p and Path(p) not in out:
            out.append(Path(p))
    return out


def gres_gpu_count(node: str, candidates: list[Path]) -> tuple[int | None, Path | None, list[str]]:
    """The node's GPU count from the first candidate whose slurm.conf/gres.conf says it:
    (count, that slurm.conf, what each candidate tried gave, for a message)."""
    tried = []
    for conf in candidates:
        if not os.path.exists(conf) and not os.path.exists(conf.parent / "gres.conf"):
            tried.append(f"{conf} (absent)")
            continue
        count = expected_gpus_for(node, conf)
        if count:
            return count, conf, tried
        unreadable = os.path.exists(conf) and not os.access(conf, os.R_OK)
        tried.append(f"{conf} (not readable)" if unreadable else f"{conf} (no gpu gres for {node})")
    return None, None, tried


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
