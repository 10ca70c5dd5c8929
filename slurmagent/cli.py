"""The `slurmagent` command line: one thin click adapter per command.

Domain errors (SlurmagentError) become one line on stderr and their exit code here, in
`main`, and nowhere else; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from pathlib import Path

import click

from .state import config as config_mod
from .errors import SlurmagentError, SlurmUnreachable
from .cli_check import command_node, echo_json


class State:
    def __init__(self, config_path: str | None, debug: bool):
        self.config_path = config_path
        self.debug = debug

    def config(self, for_root_hook: bool | None = None) -> config_mod.Config:
        """The config; as root only one that only root could have written (every root command
        may run its `[slurm]` binaries), unless `for_root_hook` says otherwise."""
        root = os.geteuid() == 0 if for_root_hook is None else for_root_hook
        return config_mod.load(self.config_path, for_root_hook=root)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """The same version as status, doctor, the decision log and build_info (state.build): `0.1.0+g<commit>`."""
    if value and not ctx.resilient_parsing:
        from .state.build import version  # start-up speed

        click.echo(f"slurmagent, version {version()}")
        ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="FILE", help="config file (default $SLURMAGENT_CONFIG or /etc/slurmagent/config.toml)")
@click.option("--debug", is_flag=True, help="show tracebacks")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and exit.")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, debug: bool) -> None:
    """Keep long GPU jobs alive on Slurm clusters of Google Cloud VMs."""
    ctx.obj = State(config_path, debug)


def _check_output_file(output: str) -> None:
    """`-o FILE` names a file in a directory that exists (never created here)."""
    path = Path(output)
    if path.is_dir():
        raise SlurmagentError(f"snapshot: -o {output} is a directory; give a file name")
    if not path.parent.is_dir():
        raise SlurmagentError(f"snapshot: -o {output}: directory {path.parent} does not exist (not created)")


def os_error_line(exc: OSError) -> str:
    """An OSError as one line: the path, then what went wrong with it."""
    name = exc.filename
    if name is None:
        return exc.strerror or str(exc)
    if exc.errno == errno.EEXIST and not os.path.isdir(name):
        return f"{name}: exists and is not a directory"
    return f"{name}: {exc.strerror or exc}" + (f" (-> {exc.filename2})" if exc.filename2 else "")


@cli.command()
@click.option("-o", "--output", metavar="FILE", help="write here instead of stdout")
@click.pass_obj
def snapshot(state: State, output: str | None) -> None:
    """Capture this node's GPU state in the replay format (with what `cuInit` answers, unless
    `[checks] off` names cuda-init: a replay judges CUDA from the file)."""
    from .commands.health import capture_snapshot  # start-up speed
    from .state.fsutil import atomic_write_text  # start-up speed

    cfg = state.config()
    if output:  # before the GPU read: a bad path is said at once
        _check_output_file(output)
    snap = capture_snapshot(cfg, command_node(None))
    if output:
        try:  # a reader never sees half a snapshot; no directory is created for a typo
            atomic_write_text(output, snap.to_json(), parents=False)
        except OSError as exc:
            raise SlurmagentError(f"snapshot: cannot write -o {output}: {exc.strerror or exc}") from None
    else:
        click.echo(snap.to_json(), nl=False)


@cli.command()
@click.pass_obj
def prolog(state: State) -> None:
    """Slurm Prolog entry point (reads SLURM_JOB_ID, SLURMD_NODENAME)."""
    from .hookmain import hook_main  # start-up speed

    sys.exit(hook_main("prolog", state.config_path))


@cli.command()
@click.pass_obj
def epilog(state: State) -> None:
    """Slurm Epilog entry point (reads SLURM_JOB_ID, SLURM_JOB_EXIT_CODE)."""
    from .hookmain import hook_main  # start-up speed

    sys.exit(hook_main("epilog", state.config_path))


@cli.command("release-held", hidden=True)
@click.argument("job_id")
@click.option("--deadline", default=60.0, show_default=True)
@click.pass_obj
def release_held(state: State, job_id: str, deadline: float) -> None:
    """Internal: release a job Slurm requeued held after our prolog failed."""
    from .actions.executor import JournalExecutor  # start-up speed
    from .slurm.commands import Slurm  # start-up speed

    if not job_id.replace("_", "").isdigit():
        raise click.BadParameter(f"not a job id: {job_id!r}")
    cfg = state.config(for_root_hook=os.geteuid() == 0)
    # the prolog journaled the release already: this watch only acts (a replay confirms it)
    releaser = JournalExecutor(cfg, Slurm.from_config(cfg), journal=None)
    sys.exit(0 if releaser.release_when_held(job_id, deadline) else 1)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_obj
def doctor(state: State, as_json: bool) -> None:
    """Check slurm.conf, config, NVML, state dir, metrics file, metadata, Compute and its permissions, bucket,
    clock, slurmctld, the watch and expiry units; say what to fix; change nothing (exit 0 all ok, 1 problems,
    2 config file missing/invalid, 3 slurmctld or a GCP endpoint gave no answer)."""
    from .commands.doctor import as_json as doctor_json, exit_code, run_doctor  # start-up speed

    results = run_doctor(state.config_path)
    if as_json:
        echo_json(doctor_json(results))
        sys.exit(exit_code(results))
    width = max(len(r.name) for r in results)
    for r in results:
        click.echo(f"{r.mark:<4} {r.name:<{width}}  {r.detail}")
        if not r.ok and r.fix:
            click.echo(f"     {'':<{width}}  fix: {r.fix}")
    sys.exit(exit_code(results))


# The command's own options and its `--` stay its own: parsing stops at the first word of CMD.
@cli.command(context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False})
@click.option("--ckpt-dir", metavar="DIR", help="local checkpoint dir (default ${TMPDIR:-/tmp}/slurmagent-<uid>/<job id>, private; %n = node)")
@click.option("--remote", metavar="gs://B/P", help="checkpoint remote (default [checkpoint] remote + /<job id>)")
@click.option("--ckpt-signal", default="USR1", show_default=True, help="signal that asks the job to checkpoint")
@click.option("--grace", type=float, metavar="SECONDS", help="how long the job may take to checkpoint [checkpoint.grace_s]")
@click.option("--max-requeues", type=int, metavar="N", help="stop after N restarts in a row without a new checkpoint [checkpoint.max_requeues]")
@click.option("--sync-interval", type=float, metavar="SECONDS", help="background sync period [checkpoint.sync_interval_s]")
@click.option("--hang-timeout", type=float, metavar="SECONDS",
              help="no progress this long is a hang (-1 adaptive, 0 off) [run.hang_timeout_s]")
@click.option("--restore-scope", type=click.Choice(["all", "node"]), default="all", show_default=True,
              help="multi-node jobs: restore the whole checkpoint on every node, or only the files each node wrote")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def run(state: State, ckpt_dir, remote, ckpt_signal, grace, max_requeues, sync_interval, hang_timeout, restore_scope,
        cmd) -> None:
    """Job-step wrapper: slurmagent run [opts] -- CMD ARGS..."""
    from .run.main import run_command  # start-up speed

    for option, key, value in (("--grace", "checkpoint.grace_s", grace), ("--sync-interval", "checkpoint.sync_interval_s",
                               sync_interval), ("--max-requeues", "checkpoint.max_requeues", max_requeues),
                              ("--hang-timeout", "run.hang_timeout_s", hang_timeout)):
        allowed = None if value is None else config_mod.out_of_range(key, value)
        if allowed:
            raise SlurmagentError(f"run: {option} {value} is out of range ({allowed})")

    try:
        code = run_command(state.config(), list(cmd), ckpt_dir=ckpt_dir, remote=remote, ckpt_signal=ckpt_signal,
                           grace=grace, max_requeues=max_requeues, sync_interval=sync_interval,
                           restore_scope=restore_scope, hang_timeout=hang_timeout)
    except OSError as exc:  # e.g. --ckpt-dir /dev/null, a regular file, /proc/1/x: one line, exit 2
        where = " (--ckpt-dir)" if ckpt_dir and str(exc.filename or "").startswith(ckpt_dir.rstrip("/")) else ""
        raise SlurmagentError(f"run: {os_error_line(exc)}{where}") from None
    sys.exit(code)


@cli.command("node-agent", hidden=True)
@click.argument("action", type=click.Choice(["restore", "sync", "evidence", "samples", "drain", "writers"]))
@click.option("--ckpt-dir", required=True)
@click.option("--remote", default="")
@click.option("--state-file", default=None)
@click.option("--attempt", type=click.IntRange(0), default=0)
@click.option("--generation", type=click.IntRange(0), default=0)
@click.option("--scope", type=click.Choice(["all", "node"]), default="all")
@click.option("--deadline", type=click.FloatRange(1.0), default=600.0)
@click.option("--transfers", type=click.IntRange(1, 256), default=16)
@click.option("--parallel-upload-mib", type=click.IntRange(0), default=0)
@click.option("--cache-gib", type=click.FloatRange(-1), default=-1.0)
@click.option("--cache-copies", type=click.IntRange(1), default=2)
@click.option("--cache-dir", default="")
@click.option("--peers", default="")
@click.option("--owner", default="")
@click.option("--private-dir", "private", multiple=True)
@click.option("--fresh", is_flag=True)
@click.option("--keep-uncommitted", type=click.IntRange(1), default=3)
@click.option("--ask", default="")
def node_agent(action, deadline, **options) -> None:
    """Internal: one node's part of a multi-node job's restore, sync, hang evidence or drain, or kill-time writers (the wrapper runs it via srun)."""
    from .run.node_agent import node_agent_main  # start-up speed: only this hidden command needs it
    sys.exit(node_agent_main(action, deadline_s=deadline, env=os.environ, **options))


class PassThrough(click.Command):
    """Hands every argument over untouched (only a lone `-h`/`--help` is click's): click would
    drop the first `--` it meets, and in `sbatch -N1 --gres=gpu:8 -- python train.py` that `--`
    is where sbatch's options end."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args in (["-h"], ["--help"]):
            return super().parse_args(ctx, args)
        ctx.params["args"] = tuple(args)
        ctx.args = []
        return []


@cli.command(cls=PassThrough, epilog="Adds --requeue, or --requeue=expedite where Slurm >= 25.11 enables it, and --open-mode=append (a requeue keeps the first attempt's output) (docs/user/wrapper.md); your own --requeue, --no-requeue or --open-mode wins.")
@click.argument("args", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def sbatch(state: State, args) -> None:
    """Submit CMD wrapped by `run`: slurmagent sbatch [sbatch opts] -- CMD ARGS..."""
    from .run.main import submit  # start-up speed

    sys.exit(submit(state.config(), list(args)))


@cli.command()
@click.option("--node", metavar="NAME", help="node name (default $SLURMD_NODENAME or the host name)")
@click.option("--interval", type=click.FloatRange(0.05, 10.0), default=0.25, show_default=True,
              help="kernel-log poll period in seconds")
@click.option("--no-nvml", is_flag=True, help="follow the kernel log only, not NVML XID events")
@click.pass_obj
def watch(state: State, node: str | None, interval: float, no_nvml: bool) -> None:
    """Long-running: drain this node at once on a drain-class XID (NVML events, kernel log)."""
    from .commands.watch import run_watch  # start-up speed

    cfg = state.config(for_root_hook=os.geteuid() == 0)
    sys.exit(run_watch(cfg, command_node(node), interval=interval, use_nvml=not no_nvml))


@cli.command()
@click.option("--node", metavar="NAME", help="node name (default $SLURMD_NODENAME or the host name)")
@click.option("--skip-recent", type=click.FloatRange(0.0), default=None, metavar="SECONDS",
              help="exit 0 at once when a prolog/epilog decision was logged this recently (default 120)")
@click.pass_obj
def healthcheck(state: State, node: str | None, skip_recent: float | None) -> None:
    """For Slurm's HealthCheckProgram: check this node, drain on failure (0 healthy, 1 unhealthy)."""
    from .commands.healthcheck import run_healthcheck  # start-up speed

    code = run_healthcheck(command_node(node), lambda: state.config(for_root_hook=os.geteuid() == 0),
                           skip_recent=skip_recent)
    sys.exit(code)


@cli.command()
@click.option("--dry-run", is_flag=True, help="print what would be repaired; call nothing")
@click.option("--json", "as_json", is_flag=True, help="with --dry-run: the plan per node as JSON")
@click.option("--force", is_flag=True, help="override the drain circuit breaker, busy nodes and the repair limit")
@click.argument("nodes", nargs=-1)
@click.pass_obj
def repair(state: State, dry_run: bool, as_json: bool, force: bool, nodes: tuple[str, ...]) -> None:
    """Repair nodes drained by slurmagent through their MIG (all of them when none named)."""
    from .core.hostlist import expand  # start-up speed
    from .commands.repair import run_repair  # start-up speed

    if as_json and not dry_run:
        raise click.UsageError("--json goes with --dry-run (a real repair reports in lines)")
    try:
        names = [n for expr in nodes for n in expand(expr)]
    except ValueError as exc:
        raise SlurmagentError(f"repair: {exc}") from None
    cfg = state.config()
    if os.geteuid() != 0 and not dry_run:
        _require_root_for_repair(cfg)
    if as_json:
        import io
        import time

        from .policy.repair_report import dry_run_json  # start-up speed

        try:  # the text lines are dropped: the JSON says the same, per node
            result = run_repair(cfg, names, dry_run=True, force=force, out=io.StringIO(), err=io.StringIO())
            doc = dry_run_json(result, cfg.repair.strategy, time.time())
        except SlurmUnreachable as exc:
            doc = dry_run_json(None, cfg.repair.strategy, time.time(), slurm_error=exc.slurm_error)
        echo_json(doc)
        sys.exit(doc["exit_code"])
    result = run_repair(cfg, names, dry_run=dry_run, force=force, out=sys.stdout, err=sys.stderr)
    sys.exit(result.exit_code)


def _require_root_for_repair(cfg: config_mod.Config) -> None:
    """`repair` drains nodes, requeues jobs and recreates VMs: root only, unless a root-owned
    config says `[repair] allow_non_root = true` (a user's own config cannot grant it)."""
    from pathlib import Path

    if cfg.repair.allow_non_root:
        try:
            config_mod.check_safe_permissions(Path(cfg.source))
            return
        except SlurmagentError:
            pass
    raise SlurmagentError(f"repair must run as root (uid {os.geteuid()}): it drains nodes, requeues jobs and "
                          "recreates VMs; use --dry-run, or set [repair] allow_non_root = true in a root-owned config")


@cli.command("resume-if-healthy")
@click.option("--node", metavar="NAME", help="node name (default $SLURMD_NODENAME or the host name)")
@click.option("--wait", "wait_s", type=click.FloatRange(0.0), default=None, metavar="SECONDS",
              help="how long to wait for slurmd to register the node [repair.resume_wait_s, 300]")
@click.pass_obj
def resume_if_healthy(state: State, node: str | None, wait_s: float | None) -> None:
    """At boot: resume this node if it is healthy and drained by slurmagent (exit 1: unhealthy)."""
    from .commands.repair import run_resume_if_healthy  # start-up speed

    sys.exit(run_resume_if_healthy(state.config(for_root_hook=os.geteuid() == 0), command_node(node),
                                   out=sys.stdout, wait_s=wait_s))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--job", "job_id", metavar="ID", help="a job's checkpoint: last commit, its age and size, the last sync, lag")
@click.option("--remote", metavar="gs://B/P", help="with --job: the job's checkpoint prefix, when not the default")
@click.pass_obj
def status(state: State, as_json: bool, job_id: str | None, remote: str | None) -> None:
    """Nodes drained by slurmagent, repair state, breaker, journal backlog, expiry countdowns;
    with --job ID, that job's checkpoint (exit 1: problems found, 3: Slurm not reachable)."""
    if job_id is not None:
        from .commands.status import collect_job_status, format_job_status  # start-up speed
        from .run.job import JOB_ID_RE

        bad = (f"--job {job_id!r}: not a Slurm job id (e.g. 77 or 77_3)" if not JOB_ID_RE.fullmatch(job_id) else
               f"--remote {remote!r}: not a gs://BUCKET/PREFIX" if remote is not None and not remote.startswith("gs://")
               else None)
        if bad:
            click.echo(f"slurmagent status: {bad}", err=True)
            sys.exit(2)
        st = collect_job_status(state.config(), job_id, remote=remote)
        echo_json(st) if as_json else click.echo(format_job_status(st))
        sys.exit(st["exit_code"])
    from .commands.status import collect_status, format_status  # start-up speed

    st = collect_status(state.config())
    echo_json(st) if as_json else click.echo(format_status(st))
    sys.exit(st["exit_code"])


@cli.command("journal")
@click.option("--replay", is_flag=True, help="apply the pending actions now")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--node", metavar="NAME", help="whose journal (default $SLURMD_NODENAME or the host name)")
@click.pass_obj
def journal_cmd(state: State, replay: bool, as_json: bool, node: str | None) -> None:
    """Show (or replay) this node's journal of pending actions (exit 1: some are pending)."""
    from .commands.journal import run_journal  # start-up speed

    sys.exit(run_journal(state.config(), command_node(node), replay=replay, as_json=as_json, out=sys.stdout))


@cli.command()
@click.option("--root", "root_dir", default="/", show_default=True, metavar="DIR", help="install into this staging tree")
@click.option("--dry-run", is_flag=True, help="say what would change, change nothing")
@click.option("--prolog-dir", metavar="DIR", help="also put the prolog shim in DIR (a prolog.d/ that "
              "`Prolog=DIR/*` runs, e.g. /slurm/custom_scripts/prolog.d on Cluster Toolkit)")
@click.option("--epilog-dir", metavar="DIR", help="also put the epilog shim in DIR (an epilog.d/ for `Epilog=DIR/*`)")
@click.option("--uninstall", is_flag=True, help="remove exactly what install wrote (an edited file is kept)")
@click.option("--binary", metavar="PATH", help="the slurmagent the shims and units run (default: this one); "
              "for upgrades by symlink: /opt/slurmagent/current/bin/slurmagent")
def install(root_dir: str, dry_run: bool, prolog_dir: str | None, epilog_dir: str | None, uninstall: bool,
            binary: str | None) -> None:
    """Install hook shims (also into a prolog.d/ epilog.d/), systemd units, logrotate and a config
    template (idempotent; a file an admin edited is kept, the new version written beside it as
    FILE.slurmagent-new)."""
    from pathlib import Path

    from .commands.doctor import install_still_needs  # start-up speed
    from .commands.install import install as do_install, systemctl_for, uninstall as do_uninstall  # start-up speed

    root = Path(root_dir)
    steps = do_uninstall(root, dry_run, systemctl_for(root)) if uninstall else do_install(
        root, dry_run=dry_run, binary=binary, prolog_dir=prolog_dir, epilog_dir=epilog_dir)
    for step in steps:
        verb = f"would {step.action}" if dry_run and step.action in ("install", "update", "remove") else step.action
        click.echo(f"{verb:<14} {step.path}" + (f"  ({step.note})" if step.note else ""))
    if uninstall:
        click.echo("then: remove slurmagent's lines from slurm.conf and scontrol reconfigure")
        return
    conf, missing = install_still_needs(root)  # the slurm.conf found as the hooks find it
    if missing:
        click.echo(f"slurm.conf ({conf}) still needs:")
        for line in missing:
            click.echo(f"  {line}")
    click.echo("then, on each GPU node: systemctl daemon-reload; systemctl enable --now slurmagent-watch "
               "slurmagent-expiry.timer; systemctl enable slurmagent-expiry.service slurmagent-resume.service")
    click.echo("on the controller: systemctl enable --now slurmagent-repair.timer; after editing slurm.conf: "
               "scontrol reconfigure")


@cli.command("expiry-watch")
@click.option("--once", is_flag=True, help="one check and exit (what slurmagent-expiry.timer runs every 30 s)")
@click.option("--node", metavar="NAME", help="node name (default $SLURMD_NODENAME or the host name)")
@click.option("--interval", type=click.FloatRange(1.0, 3600.0), default=30.0, show_default=True,
              help="loop mode: seconds between checks (metadata notices wake it at once)")
@click.pass_obj
def expiry_watch(state: State, once: bool, node: str | None, interval: float) -> None:
    """Learn the VM's termination time, drain ahead of it, trigger the flush of running jobs (--once: exit 1
    when the time cannot be learned for a lasting reason, e.g. HTTP 403)."""
    from .commands.expiry import run_expiry_watch  # start-up speed

    cfg = state.config(for_root_hook=os.geteuid() == 0)
    sys.exit(run_expiry_watch(cfg, command_node(node), once=once, interval_s=interval))


from .cli_bucket import ckpt, report  # noqa: E402 - the commands that read a prefix live beside: this module's size
from .cli_check import check  # noqa: E402 - beside, for this module's size
from .cli_dev import demo  # noqa: E402 - the dev harness's command: shown only from a checkout

cli.add_command(ckpt)
cli.add_command(report)
cli.add_command(check)
cli.add_command(demo)


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    debug, as_json = "--debug" in args, "--json" in (args[:args.index("--")] if "--" in args else args)

    def failed(line: str, code: int) -> int:  # stderr; with --json also a JSON object on stdout
        click.echo(line, err=True)
        if as_json:
            echo_json({"ok": False, "error": line.split(": ", 1)[1], "exit_code": code})
        return code

    try:
        cli.main(args=argv, prog_name="slurmagent", standalone_mode=False)
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except click.exceptions.Abort:
        return click.echo("aborted", err=True) or 130
    except click.ClickException as exc:
        return failed(f"Error: {exc.format_message()}", 2) if as_json else (exc.show() or 2)
    except SlurmagentError as exc:
        if debug:
            traceback.print_exc()
        return failed(f"slurmagent: {exc}", exc.exit_code)
    except OSError as exc:  # a path the user gave (or the machine) said no: one line, not a traceback
        if debug:
            traceback.print_exc()
        return failed(f"slurmagent: {os_error_line(exc)}", 2)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
