"""Wiring for `slurmagent run` and `slurmagent sbatch`: config + Slurm + storage -> Supervisor."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from . import expiry_state
from .config import Config
from .errors import SlurmagentError
from .host import node_name, slurmagent_argv
from .slurm import Slurm
from .child_process import RequeueHold
from .own_requeue import RequeueVerb
from .run_setup import (JobIdentity, RunOptions, WrapperError, default_ckpt_dir, expand_node, make_private_dir,
                        parse_signal)
from .wrapper import FLUSH_SIGNALS, Supervisor

def build_options(cfg: Config, cmd: list[str], env, ident: JobIdentity, *, ckpt_dir=None, remote=None,
                  ckpt_signal="USR1", grace=None, max_requeues=None, sync_interval=None) -> RunOptions:
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise WrapperError("nothing to run: slurmagent run [opts] -- CMD ARGS...")
    ck = cfg.checkpoint
    if remote is None and ck.remote:
        remote = ck.remote.rstrip("/") + "/" + ident.name
    for name, value in (("--grace", grace), ("--max-requeues", max_requeues), ("--sync-interval", sync_interval)):
        if value is not None and value < 0:
            raise WrapperError(f"{name} must not be negative")
    node = node_name(None, env)  # this node's expiry state, never another slurmd's on the same host
    return RunOptions(
        cmd=cmd,
        ckpt_dir=Path(expand_node(ckpt_dir, env)) if ckpt_dir else make_private_dir(default_ckpt_dir(env, ident)),
        remote=remote or "",
        ckpt_signal=parse_signal(ckpt_signal),
        grace_s=ck.grace_s if grace is None else grace,
        max_requeues=ck.max_requeues if max_requeues is None else max_requeues,
        sync_interval_s=ck.sync_interval_s if sync_interval is None else max(sync_interval, 0.5),
        flush_lead_s=cfg.expiry.flush_lead_s,
        expiry_files=expiry_state.files_for(cfg, node),
        multi_node=_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")) > 1,
    )


def store_tunables(cfg: Config) -> dict:
    """The checkpoint store's keyword arguments from `[checkpoint]`."""
    ck = cfg.checkpoint
    return {"max_workers": ck.transfers, "parallel_upload_mib": ck.parallel_upload_mib}


def node_agent_options(cfg: Config) -> list[str]:
    """The same tunables for the node agents of a multi-node job (they do not read the config)."""
    ck = cfg.checkpoint
    return ["--transfers", str(ck.transfers), "--parallel-upload-mib", str(ck.parallel_upload_mib)]


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def run_command(cfg: Config, cmd: list[str], restore_scope: str = "all", **opts) -> int:
    # From here to our exit a flush signal is recorded, never the default action: one that
    # comes before the supervisor starts is acted on by it; one after (Slurm signals the batch
    # step again once requeued) is a no-op. A Python handler, unlike SIG_IGN, is reset to the
    # default in the child by exec.
    early: list[int] = []
    for s in FLUSH_SIGNALS:
        signal.signal(s, lambda signum, _frame: early.append(signum))
    env = dict(os.environ)
    ident = JobIdentity.from_env(env)
    options = build_options(cfg, cmd, env, ident, **opts)
    store = None
    if options.remote:
        from .gcp.storage import GcsCheckpointStore  # google only with a remote: start-up speed

        store = GcsCheckpointStore(options.remote, **store_tunables(cfg))
    # A multi-node job's batch step covers every node's --ckpt-dir through node agents.
    from .allocation import allocation_store  # start-up speed: single-node runs never load it

    whole_job = allocation_store(env, store, ckpt_dir_option=opts.get("ckpt_dir"), scope=restore_scope,
                                 agent_options=node_agent_options(cfg))
    slurm = Slurm.from_config(cfg) if ident.platform == "slurm" else None
    hold = _requeue_hold(cfg, env, ident) if slurm is not None else None
    metrics = _job_metrics(cfg, env.get("SLURMD_NODENAME"))
    sup = Supervisor(options, ident, whole_job or store, _requeue_of(slurm) if slurm else None, env,
                     hold=hold, metrics=metrics, read_job=slurm.job if slurm else None)
    if whole_job is not None:
        whole_job.trainer_running = sup.child_running
    try:
        if slurm is not None:
            warn_if_not_requeueable(sup, slurm, ident.job_id)
        if store is None:
            sup.say("no [checkpoint] remote: checkpoints stay on this node's disk only")
        sup.pending.extend(early)
        outcome = sup.run()
    finally:
        if hold is not None:
            hold.cleanup()
    if metrics is not None:
        _record_metrics(metrics, outcome)
    sup.say(outcome.summary)
    return outcome.exit_code


def _requeue_of(slurm: Slurm):
    """The wrapper's requeue: `requeue`, or the `requeuehold` its job asked for (held)."""
    def requeue(job: str, verb: RequeueVerb = RequeueVerb()) -> None:
        slurm.requeue([job], hold=verb.hold, special_exit=verb.special_exit)
    return requeue


def _requeue_hold(cfg: Config, env, ident: JobIdentity) -> RequeueHold | None:
    """Our `scontrol` first on the child's PATH, holding its requeue of its own job."""
    real = shutil.which(cfg.slurm.scontrol, path=env.get("PATH"))
    if real is None or not ident.aliases:
        return None
    return RequeueHold(ident.aliases, os.path.abspath(real))


def _job_metrics(cfg: Config, node: str | None):
    """The node's metrics when this (possibly unprivileged) job may write them, else None."""
    from . import metrics  # only for a job that may write them: start-up speed

    m = metrics.for_node(cfg, node)
    return m if os.access(m.state_dir, os.W_OK) else None


def _record_metrics(m, outcome) -> None:
    """Flush duration and bytes synced."""
    gauges = {("slurmagent_flush_seconds", ()): outcome.flush_seconds} if outcome.flushed else {}
    add = {("slurmagent_bytes_synced_total", ()): outcome.bytes_synced}
    if outcome.requeued:
        add[("slurmagent_requeues_total", ())] = 1
    m.update(set_=gauges, add=add)


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
    extra = ["--requeue"]
    if not any(o == "--signal" or o.startswith("--signal=") for o in sbatch_opts):
        extra.append(f"--signal=B:{signal.Signals(signal.SIGUSR1).name[3:]}@{cfg.checkpoint.signal_lead_s}")
    fd, script = tempfile.mkstemp(prefix="slurmagent-sbatch-", suffix=".sh")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(WRAPPER_SCRIPT.format(slurmagent=" ".join(shlex.quote(a) for a in slurmagent_argv())))
        os.chmod(script, 0o755)
        proc = Slurm.from_config(cfg).sbatch([*sbatch_opts, *extra, script, *run_args])
    finally:
        os.unlink(script)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode
