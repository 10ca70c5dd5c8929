"""Wiring for `slurmagent run` and `slurmagent sbatch`: config + Slurm + storage -> Supervisor."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from ..actions.executor import JournalExecutor
from ..checkpoint import report as ckpt_report
from ..state import expiry_state
from ..checkpoint.report import CheckpointReport
from ..policy.job_requests import JOB_PARTS
from ..state.config import Config
from .cut_store import QuietCutStore
from ..errors import SlurmagentError
from ..state.host import node_name, slurmagent_argv
from ..slurm import env as slurm_env
from ..slurm.commands import Slurm
from ..slurm.features import EXPEDITE, SlurmFeatures, requeue_option, user_chose_open_mode, user_chose_requeue
from .child import RequeueHold
from .ledger import AttemptLedger, LedgerReport, expiry_source, faulty_node
from .identity import SUBMISSION_ENV, new_owner
from ..state.private_dirs import user_tmp_parent
from ..state.progress import PROGRESS_ENV
from .requeue import RequeueVerb
from .job import (
    JobIdentity,
    RunOptions,
    WrapperError,
    default_ckpt_dir,
    dir_owner,
    expand_node,
    fresh_attempt,
    explicit_ckpt_dir,
    make_private_dir,
    parse_signal,
)
from .supervisor import FLUSH_SIGNALS, Supervisor, is_fault

REPORT_INTERVAL_S = 600.0  # the checkpoint's state on the job's stderr at most this often (and on changes)
CONFIG_READ_S = 5.0  # `slurmagent sbatch`'s one `scontrol show config` (what the controller offers) at most

def build_options(cfg: Config, cmd: list[str], env, ident: JobIdentity, *, ckpt_dir=None, remote=None,
                  ckpt_signal="USR1", grace=None, max_requeues=None, sync_interval=None) -> RunOptions:
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise WrapperError("nothing to run: slurmagent run [opts] -- CMD ARGS...")
    ck = cfg.checkpoint
    per_job_remote = remote is None and bool(ck.remote)
    if per_job_remote:
        remote = ck.remote.rstrip("/") + "/" + ident.name
    for name, value in (("--grace", grace), ("--max-requeues", max_requeues), ("--sync-interval", sync_interval)):
        if value is not None and value < 0:
            raise WrapperError(f"{name} must not be negative")
    node = node_name(None, env)  # this node's expiry state, never another slurmd's on the same host
    return RunOptions(
        cmd=cmd,
        # explicit or default: owned by the user, writable by nobody else, created 0700
        ckpt_dir=(explicit_ckpt_dir(Path(expand_node(ckpt_dir, env)), defer_unusable=ident.platform == "slurm")
                  if ckpt_dir
                  else make_private_dir(default_ckpt_dir(env, ident))),
        remote=remote or "",
        ckpt_signal=parse_signal(ckpt_signal),
        grace_s=ck.grace_s if grace is None else grace,
        max_requeues=ck.max_requeues if max_requeues is None else max_requeues,
        sync_interval_s=ck.sync_interval_s if sync_interval is None else max(sync_interval, 0.5),
        flush_lead_s=cfg.expiry.flush_lead_s,
        expiry_files=expiry_state.files_for(cfg, node),
        multi_node=_multi_node(env),
        per_job_remote=per_job_remote,
        keep_uncommitted=ck.keep_uncommitted,
    )


def store_tunables(cfg: Config) -> dict:
    """The checkpoint store's keyword arguments from `[checkpoint]`."""
    ck = cfg.checkpoint
    return {"max_workers": ck.transfers, "parallel_upload_mib": ck.parallel_upload_mib,
            "keep_commits": ck.keep_commits, "gc_grace_s": ck.gc_grace_s,
            "local_cache_gib": ck.local_cache_gib if ck.local_cache else -1, "local_cache_dir": ck.local_cache_dir,
            "local_cache_copies": ck.keep_commits}


def node_agent_options(cfg: Config) -> list[str]:
    """The same tunables for the node agents of a multi-node job (they do not read the config)."""
    ck = cfg.checkpoint
    return ["--transfers", str(ck.transfers), "--parallel-upload-mib", str(ck.parallel_upload_mib),
            "--cache-gib", f"{ck.local_cache_gib if ck.local_cache else -1:g}", "--cache-copies", str(ck.keep_commits),
            "--keep-uncommitted", str(ck.keep_uncommitted), *(["--cache-dir", ck.local_cache_dir] if ck.local_cache_dir else [])]


def _multi_node(env) -> bool:
    """Whether the job holds more than one node (a malformed count: one node, as Allocation reads it)."""
    try:
        return slurm_env.num_nodes(env) > 1
    except ValueError:
        return False


def run_command(cfg: Config, cmd: list[str], restore_scope: str = "all", hang_timeout: float | None = None,
                **opts) -> int:
    # From here to our exit a flush signal is recorded, never the default action: one that
    # comes before the supervisor starts is acted on by it; one after (Slurm signals the batch
    # step again once requeued) is a no-op. A Python handler, unlike SIG_IGN, is reset to the
    # default in the child by exec.
    early: list[int] = []
    for s in FLUSH_SIGNALS:
        signal.signal(s, lambda signum, _frame: early.append(signum))
    started = time.time()  # the attempt's start in the goodput ledger
    env = dict(os.environ)
    ident = JobIdentity.from_env(env)
    options = build_options(cfg, cmd, env, ident, **opts)
    store = None
    if options.remote:
        from ..checkpoint.gcs.store import GcsCheckpointStore  # google only with a remote: start-up speed

        store = GcsCheckpointStore(options.remote, **store_tunables(cfg))
    slurm = Slurm.from_config(cfg) if ident.platform == "slurm" else None
    hold = _requeue_hold(cfg, env, ident) if slurm is not None else None
    # A multi-node job's batch step covers every node's --ckpt-dir through node agents; their
    # restore also makes the hold's directory (on every node's PATH) private on every node.
    from .multinode import allocation_store  # start-up speed: single-node runs never load it

    restore_options = ["--owner", dir_owner(ident), *(["--fresh"] if fresh_attempt(ident) else []),
                       *(["--private-dir", str(hold.dir)] if hold else [])]
    try:
        whole_job = allocation_store(env, store, ckpt_dir_option=opts.get("ckpt_dir"), scope=restore_scope,
                                     agent_options=node_agent_options(cfg), restore_options=restore_options,
                                     settle_s=cfg.checkpoint.settle_s)
    except BaseException:
        if hold is not None:
            hold.cleanup()
        raise
    metrics = _job_metrics(cfg, slurm_env.slurmd_node(env), ident)
    # A single-node job's periodic commits take only what was quiet for a whole round, as a multi-node job's do.
    job_store = whole_job or (QuietCutStore(store, settle_s=cfg.checkpoint.settle_s) if store is not None else None)
    report = checkpoint_report(env, ident, options, store is not None)
    ledger = attempt_ledger(env, ident, options, store, started) if report is not None else None
    if ledger is not None:
        report = LedgerReport(report, ledger)
    # the action API's, through an executor without a journal: the wrapper runs as the job's user,
    # owns no root journal, and retries itself (`requeue.py`); Slurm's refusal is raised to it
    executor = JournalExecutor(cfg, slurm, slurm_env.slurmd_node(env), journal=None) if slurm else None
    sup = Supervisor(options, ident, job_store, _requeue_of(executor) if executor else None, env,
                     hold=hold, metrics=metrics, report=report, read_job=slurm.job if slurm else None)
    if job_store is not None:
        job_store.trainer_running = sup.child_running
        job_store.open_files = sup.open_files  # a file being written is never committed
    if executor is not None:
        sup.slurm_nodes = executor  # a restore failing on a node's disk: requeued without it
    sup.hang = hang_monitor(cfg, env, ident, options, hang_timeout, sup, whole_job)
    if ledger is not None and sup.hang is not None:
        ledger.step_now = sup.hang.current_step  # the step a commit holds, where the trainer declared none
    try:
        if slurm is not None:
            warn_if_not_requeueable(sup, slurm, ident.job_id)
        if store is None:
            sup.say("no [checkpoint] remote: checkpoints stay on this node's disk only")
        sup.pending.extend(early)
        try:
            outcome = sup.run()
        except Exception as exc:  # not starting (the restore failed): the ledger says so, then the error
            if ledger is not None:
                ledger.ended(None, error=f"not started: {exc}")
            raise
    finally:
        if hold is not None:
            hold.cleanup()
        if sup.hang is not None:
            shutil.rmtree(sup.hang.progress_dir, ignore_errors=True)
            if sys.stderr is sup.hang.own_stream:  # an in-process caller gets its stderr back
                sys.stderr = sup.hang.own_stream.inner
    if metrics is not None:
        _record_metrics(metrics, outcome)
    if report is not None:
        report.ended(outcome.summary)
    if ledger is not None:
        record = end_ledger(ledger, outcome, options, env, slurm, sup.hang)
        if metrics is not None:
            _record_goodput(metrics, record)
    sup.say(outcome.summary)
    return outcome.exit_code


def hang_monitor(cfg: Config, env: dict, ident: JobIdentity, options: RunOptions, timeout: float | None,
                 sup: Supervisor, whole_job=None):
    """The hang watch (`hang/monitor.py`) with its private progress directory, named to the
    trainer in SLURMAGENT_PROGRESS_DIR (through `env`, which the child gets); None when off.
    A multi-node job's agents make that directory on every node and report its ranks (`hang/remote.py`)."""
    from ..hang.monitor import CountingStream, HangMonitor  # start-up speed: built once, after the config
    from ..hang.remote import BATCH_NODE_ENV, RemoteRanks  # start-up speed (with the monitor)
    from ..policy.stall import StallRule, StragglerRule  # start-up speed (with the monitor)

    rc = cfg.run
    rule = StallRule(timeout_s=rc.hang_timeout_s if timeout is None else timeout,
                     first_progress_s=rc.hang_first_progress_s, floor_s=min(rc.hang_floor_s, rc.hang_ceiling_s),
                     ceiling_s=rc.hang_ceiling_s, blind_floor_s=rc.hang_blind_floor_s)
    if rule.off:
        return None
    progress_dir = Path(tempfile.mkdtemp(prefix="slurmagent-progress-", dir=user_tmp_parent()))
    own = sys.stderr = CountingStream(sys.stderr)  # our lines in the job's output are not its progress
    if sup.err is own.inner:
        sup.err = own
    say = sup.say
    env[PROGRESS_ENV] = str(progress_dir)
    node = slurm_env.slurmd_node(env) or ""
    socket_path = cfg.node_path(cfg.watch.channel_socket, node) if ident.platform == "slurm" and node else ""

    def ask(rule_name: str, detail: str, op: str = "drain", about: str = "", pid: int = 0) -> str:
        if not socket_path:
            return "no root channel (not a Slurm job, or [watch] channel_socket empty)"
        request = {"op": op, "job": ident.job_id, "node": about or node, "rule": rule_name, "detail": detail,
                   **({"pid": pid} if pid else {})}
        if about and about != node and op in ("drain", "count") and rule_name == "hang" and remote is not None:
            # only that node's root sees its processes: asked there by the job's agent (node-agent drain)
            return remote.ask_root_there(about, {**request, "socket": cfg.node_path(cfg.watch.channel_socket, about)})
        from ..actions.channel_client import DRAIN_DEADLINE_S, DRAIN_TIMEOUT_S, answer_line, ask_root  # start-up speed

        try:
            if op == "drain":  # root looks itself first (its GPU check may take 20 s)
                return answer_line(ask_root(socket_path, request, timeout_s=DRAIN_TIMEOUT_S, deadline_s=DRAIN_DEADLINE_S))
            return answer_line(ask_root(socket_path, request))
        except (OSError, ValueError) as exc:
            return f"no answer from root at {socket_path} ({exc})"

    def straggler(rank: int, detail: str, where: str) -> None:  # `where`: the rank's node, any of the job's
        if rc.straggler_action == "drain":
            say(f"straggler: drain of {where} asked (it leaves at the job's next requeue): "
                f"{ask('straggler', detail, about=where)}")
        else:
            answer = ask("straggler", detail, op="report", about=where)
            if not answer.startswith("granted"):
                say(f"straggler: not in root's decision log: {answer}")

    remote = None
    if whole_job is not None:  # the other nodes' ranks, through the node agents
        remote = RemoteRanks(node, progress_dir, options.ckpt_dir, ask=getattr(whole_job.launcher, "payloads", None))
        whole_job.restore_options += ["--private-dir", str(progress_dir)]  # made on every node before the ranks start
        whole_job.peer_env.update({PROGRESS_ENV: str(progress_dir), BATCH_NODE_ENV: node})  # the agents' environment
        whole_job.on_reports = remote.take
    return HangMonitor(rule, progress_dir=progress_dir, ckpt_dir=options.ckpt_dir, node=node,
                       job=ident.job_id if ident.platform == "slurm" else ident.name, attempt=ident.restart_count,
                       say=say, ask_drain=lambda about, detail, pid: ask("hang", detail, about=about, pid=pid),
                       ask_count=lambda about, detail, pid: ask("hang", detail, op="count", about=about, pid=pid),
                       remote=remote,
                       straggler=StragglerRule(rc.straggler_window_s, rc.straggler_factor, rc.straggler_windows),
                       straggler_report=straggler, own_stream=own,
                       stacks="" if rc.hang_stack_samples else "stack samples are off ([run] hang_stack_samples)")


def checkpoint_report(env, ident: JobIdentity, options: RunOptions, remote: bool) -> CheckpointReport | None:
    """The owner's view of the checkpoint (stderr lines, `status --job`); None without a bucket."""
    if not remote:
        return None
    # by the id the user types (`status --job ID`); a Cloud Run task by its prefix name
    record = ckpt_report.record_path(env, os.geteuid(), ident.job_id if ident.platform == "slurm" else ident.name)
    try:
        make_private_dir(record.parent)
    except WrapperError:
        record = None  # the stderr lines still come; `status --job` reads the bucket
    return CheckpointReport(lambda line: print(f"slurmagent run: {line}", file=sys.stderr, flush=True),
                            job=ident.job_id, attempt=ident.restart_count, remote=options.remote,
                            ckpt_dir=str(options.ckpt_dir), node=slurm_env.slurmd_node(env) or "", record=record,
                            interval_s=REPORT_INTERVAL_S, behind_s=max(3 * options.sync_interval_s, 60.0))


def attempt_ledger(env, ident: JobIdentity, options: RunOptions, store, started: float):
    """This attempt's goodput ledger beside the checkpoint (`run/ledger.py`)."""
    from ..checkpoint.gcs.ledger import LedgerBucket  # start-up speed: only with a remote

    bucket = LedgerBucket(options.remote, client=getattr(store, "client", None))
    return AttemptLedger(
        bucket, ident.job_id if ident.platform == "slurm" else ident.name, ident.restart_count, env, options.ckpt_dir,
        started=started, say=lambda line: print(f"slurmagent run: {line}", file=sys.stderr, flush=True),
        submission=ident.submission, platform=ident.platform)


def _record_goodput(m, record: dict) -> None:
    """The attempt's seconds by part into the node's counters (goodput = progress / all)."""
    from ..core.goodput import attempt_parts  # start-up speed

    try:
        parts = attempt_parts(record, None)["parts"]
        m.update(add={("slurmagent_job_seconds_total", (("part", p),)): parts[p] for p in JOB_PARTS})
        # a hang is root's to count, from the drain or count it grants (actions/job_channel.py)
    except Exception:  # noqa: BLE001 - metrics never fail the job
        pass


def end_ledger(ledger, outcome, options: RunOptions, env, slurm, hang=None) -> dict:
    """Why the attempt ended, from what this node knows: the expiry state, a node drained for a fault;
    when the ranks' progress began and last moved (the hang watch: the report's hang detection)."""
    source = expiry_source(options.expiry_files, options.flush_lead_s + 300.0) \
        if outcome.flushed else ""
    node = fault = ""
    if is_fault(outcome.flush_cause) and slurm is not None:
        node, fault = faulty_node(slurm, env)
    return ledger.ended(outcome, expiry_source=source, fault_node=node, fault=fault,
                        progress=hang.progress_times() if hang is not None else (None, None),
                        steps=hang.progress_steps() if hang is not None else (None, None, None))


def _requeue_of(executor: JournalExecutor):
    """The wrapper's requeue: `requeue`, or the `requeuehold` its job asked for (held)."""

    def requeue(job: str, verb: RequeueVerb = RequeueVerb()) -> None:
        executor.requeue_jobs([job], hold=verb.hold, special_exit=verb.special_exit)
    return requeue


def _requeue_hold(cfg: Config, env, ident: JobIdentity) -> RequeueHold | None:
    """Our `scontrol` first on the child's PATH, holding its requeue of its own job."""
    real = shutil.which(cfg.slurm.scontrol, path=env.get("PATH"))
    if real is None or not ident.aliases:
        return None
    return RequeueHold(ident.aliases, os.path.abspath(real))


def _job_metrics(cfg: Config, node: str | None, ident: JobIdentity):
    """The node's metrics when this job may write them (root); else root's `watch` takes them
    over its channel (the job's user: a default install); None outside Slurm or without it."""
    from ..state import metrics  # only for a job that may write them: start-up speed

    m = metrics.for_node(cfg, node)
    if os.access(m.state_dir, os.W_OK):
        return m
    socket_path = cfg.node_path(cfg.watch.channel_socket, node)
    if ident.platform != "slurm" or not node or not socket_path or not os.path.exists(socket_path):
        return None
    from ..actions.channel_client import ChannelMetrics  # only for a job that may not write them: start-up speed

    return ChannelMetrics(socket_path, ident.job_id, node,
                          lambda line: print(f"slurmagent run: {line}", file=sys.stderr, flush=True))


def _record_metrics(m, outcome) -> None:
    """Flush duration and bytes synced."""
    gauges = {("slurmagent_flush_seconds", ()): outcome.flush_seconds} if outcome.flushed else {}
    add = {("slurmagent_bytes_synced_total", ()): outcome.bytes_synced}
    if outcome.requeued:
        add[("slurmagent_requeues_total", ())] = 1
    m.update(set_=gauges, add=add)


def submit_requeue_option(slurm: Slurm) -> str:
    """`--requeue=expedite` where the controller honours it (one `scontrol show config`, within
    CONFIG_READ_S), else `--requeue`; said on stderr when expedited (a job failing by itself is held)."""
    try:
        features = SlurmFeatures.from_config(slurm.show_config(min(slurm.timeout_s, CONFIG_READ_S)))
    except SlurmagentError:
        features = None  # sbatch itself says what is wrong with Slurm; submit as before 25.11
    option = requeue_option(features)
    if option == EXPEDITE:
        print(f"slurmagent sbatch: {EXPEDITE} (Slurm {features.version_text}, enable_expedited_requeue): restarts at "
              "once after a requeue or a node failure; if it fails by itself Slurm holds it (REQUEUE_HOLD: "
              "scontrol release or scancel); pass --requeue for the plain one", file=sys.stderr)
    return option


def warn_if_not_requeueable(sup: Supervisor, slurm: Slurm, job_id: str) -> None:
    try:
        job = slurm.job(job_id)
    except SlurmagentError as exc:
        sup.say(f"cannot read job {job_id} from Slurm ({exc}); requeue may fail")
        return
    if job is not None and not job.ambiguous and not job.requeue:
        sup.say(f"WARNING: job {job_id} is not requeueable (Requeue=0): submit with --requeue "
                "(slurmagent sbatch does) or it will end instead of restarting")


WRAPPER_SCRIPT = """#!/bin/sh
# Written by `slurmagent sbatch`: the batch step IS the wrapper, so the end-of-time
# signal (--signal=B:USR1@LEAD) and `scancel --batch` reach it. Arguments come from argv.
# The submission id is the checkpoint's identity: the same at every requeue (Slurm keeps
# this script), new for every submission, whatever --export says.
{submission_env}={submission}
export {submission_env}
exec {slurmagent} run "$@"
"""


def submit(cfg: Config, args: list[str]) -> int:
    """`slurmagent sbatch [sbatch opts] -- [run opts --] CMD ARGS`: wrap and submit.

    The job's argv reaches the wrapper as the batch script's arguments, never through a
    shell string, so quotes, `;` and `$()` in them stay plain data."""
    if "--" not in args:
        raise WrapperError("usage: slurmagent sbatch [sbatch options] -- CMD ARGS...")
    split = args.index("--")
    sbatch_opts, rest = args[:split], args[split + 1:]
    cmd = rest[rest.index("--") + 1:] if "--" in rest else rest
    run_args = rest if "--" in rest else ["--", *rest]
    if not cmd:
        raise WrapperError("nothing to run: slurmagent sbatch [sbatch options] -- CMD ARGS...")
    slurm = Slurm.from_config(cfg)
    extra = [] if user_chose_requeue(sbatch_opts, dict(os.environ)) else [submit_requeue_option(slurm)]
    if not user_chose_open_mode(sbatch_opts, dict(os.environ)):
        extra.append("--open-mode=append")  # a requeue would truncate the first attempt's output
    if not any(o == "--signal" or o.startswith("--signal=") for o in sbatch_opts):
        extra.append(f"--signal=B:{signal.Signals(signal.SIGUSR1).name[3:]}@{cfg.checkpoint.signal_lead_s}")
    fd, script = tempfile.mkstemp(prefix="slurmagent-sbatch-", suffix=".sh")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(WRAPPER_SCRIPT.format(slurmagent=" ".join(shlex.quote(a) for a in slurmagent_argv()),
                                           submission_env=SUBMISSION_ENV, submission=new_owner()))
        os.chmod(script, 0o755)
        proc = slurm.sbatch([*sbatch_opts, *extra, script, *run_args])
    finally:
        os.unlink(script)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode
