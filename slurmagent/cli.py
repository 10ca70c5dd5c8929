"""The `slurmagent` command line: one thin click adapter per command.

Domain errors (SlurmagentError) become one line on stderr and their exit code here, in
`main`, and nowhere else; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import click

from . import config as config_mod
from .errors import SlurmagentError


class State:
    def __init__(self, config_path: str | None, debug: bool):
        self.config_path = config_path
        self.debug = debug

    def config(self, for_root_hook: bool = False) -> config_mod.Config:
        return config_mod.load(self.config_path, for_root_hook=for_root_hook)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="FILE", help="config file (default $SLURMAGENT_CONFIG or /etc/slurmagent/config.toml)")
@click.option("--debug", is_flag=True, help="show tracebacks")
@click.version_option(package_name="slurmagent")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, debug: bool) -> None:
    """Keep long GPU jobs alive on Slurm clusters of Google Cloud VMs."""
    ctx.obj = State(config_path, debug)


def _node_name(node: str | None) -> str:
    return node or os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]


@cli.command()
@click.option("--snapshot", "snapshot_file", metavar="FILE", help="judge this replay snapshot instead of this node")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--node", metavar="NAME", help="node name (default $SLURMD_NODENAME or the host name)")
@click.pass_obj
def check(state: State, snapshot_file: str | None, as_json: bool, node: str | None) -> None:
    """Run the health checks and print findings (exit 0 healthy, 1 unhealthy)."""
    from dataclasses import replace

    from .health import evaluate

    cfg = state.config()
    name = _node_name(node)
    if snapshot_file:
        cfg = replace(cfg, health=replace(cfg.health, snapshot=snapshot_file, kernel_log_enabled=False))
    report = evaluate(cfg, name, commit_cursor=False)
    if as_json:
        click.echo(json.dumps({"node": name, **report.to_dict()}, indent=1))
    else:
        verdict = "healthy" if report.healthy else "UNHEALTHY"
        seen = f"{report.gpus_seen} GPU(s)" + (f", {report.expected_gpus} expected" if report.expected_gpus is not None else "")
        click.echo(f"{name}: {verdict} ({seen})")
        for f in report.findings:
            click.echo(f"  {f.severity.name:<5} {f.summary}")
        if not report.healthy:
            from .hooks import reason_for

            click.echo(f"  drain reason: {reason_for(report)}")
    sys.exit(0 if report.healthy else 1)


@cli.command()
@click.option("-o", "--output", metavar="FILE", help="write here instead of stdout")
@click.pass_obj
def snapshot(state: State, output: str | None) -> None:
    """Capture this node's GPU state in the replay format."""
    from . import nvml
    from .snapshot import save

    cfg = state.config()
    snap = nvml.read_snapshot_with_deadline(cfg.health.timeout_s, hostname=_node_name(None))
    if output:
        save(snap, output)
    else:
        click.echo(snap.to_json(), nl=False)


@cli.command()
def prolog() -> None:
    """Slurm Prolog entry point (reads SLURM_JOB_ID, SLURMD_NODENAME)."""
    from .hookmain import hook_main

    sys.exit(hook_main("prolog"))


@cli.command()
def epilog() -> None:
    """Slurm Epilog entry point (reads SLURM_JOB_ID, SLURM_JOB_EXIT_CODE)."""
    from .hookmain import hook_main

    sys.exit(hook_main("epilog"))


@cli.command("release-held", hidden=True)
@click.argument("job_id")
@click.option("--deadline", default=60.0, show_default=True)
@click.pass_obj
def release_held(state: State, job_id: str, deadline: float) -> None:
    """Internal: release a job Slurm requeued held after our prolog failed."""
    from .hooks import release_when_held
    from .slurm import Slurm

    if not job_id.replace("_", "").isdigit():
        raise click.BadParameter(f"not a job id: {job_id!r}")
    cfg = state.config(for_root_hook=os.geteuid() == 0)
    sys.exit(0 if release_when_held(Slurm.from_config(cfg), job_id, deadline) else 1)


@cli.command()
@click.pass_obj
def doctor(state: State) -> None:
    """Check slurm.conf, the config file, NVML and the state dir; say what to fix."""
    from .doctor import run_doctor

    results = run_doctor(state.config_path)
    width = max(len(r.name) for r in results)
    for r in results:
        mark = "ok  " if r.ok else "FAIL"
        click.echo(f"{mark} {r.name:<{width}}  {r.detail}")
        if not r.ok and r.fix:
            click.echo(f"     {'':<{width}}  fix: {r.fix}")
    sys.exit(0 if all(r.ok for r in results) else 1)


@cli.command(context_settings={"ignore_unknown_options": False})
@click.option("--ckpt-dir", metavar="DIR", help="local checkpoint dir (default ${TMPDIR:-/tmp}/slurmagent/<job id>; %n = node)")
@click.option("--remote", metavar="gs://B/P", help="checkpoint remote (default [checkpoint] remote + /<job id>)")
@click.option("--ckpt-signal", default="USR1", show_default=True, help="signal that asks the job to checkpoint")
@click.option("--grace", type=float, metavar="SECONDS", help="how long the job may take to checkpoint [checkpoint.grace_s]")
@click.option("--max-requeues", type=int, metavar="N", help="requeue at most N times [checkpoint.max_requeues]")
@click.option("--sync-interval", type=float, metavar="SECONDS", help="background sync period [checkpoint.sync_interval_s]")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def run(state: State, ckpt_dir, remote, ckpt_signal, grace, max_requeues, sync_interval, cmd) -> None:
    """Job-step wrapper: slurmagent run [opts] -- CMD ARGS..."""
    from .runner import run_command

    sys.exit(run_command(state.config(), list(cmd), ckpt_dir=ckpt_dir, remote=remote, ckpt_signal=ckpt_signal,
                         grace=grace, max_requeues=max_requeues, sync_interval=sync_interval))


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def sbatch(state: State, args) -> None:
    """Submit CMD wrapped by `run`: slurmagent sbatch [sbatch opts] -- CMD ARGS..."""
    from .runner import submit

    sys.exit(submit(state.config(), list(args)))


# --- issue 7: health between jobs (watch, healthcheck) ---------------------------------------


@cli.command()
@click.option("--node", metavar="NAME", help="node name (default $SLURMD_NODENAME or the host name)")
@click.option("--interval", type=click.FloatRange(0.05, 10.0), default=0.25, show_default=True,
              help="kernel-log poll period in seconds")
@click.option("--no-nvml", is_flag=True, help="follow the kernel log only, not NVML XID events")
@click.pass_obj
def watch(state: State, node: str | None, interval: float, no_nvml: bool) -> None:
    """Long-running: drain this node at once on a drain-class XID (NVML events, kernel log)."""
    from .watch import run_watch

    cfg = state.config(for_root_hook=os.geteuid() == 0)
    sys.exit(run_watch(cfg, _node_name(node), interval=interval, use_nvml=not no_nvml))


@cli.command()
@click.option("--node", metavar="NAME", help="node name (default $SLURMD_NODENAME or the host name)")
@click.option("--skip-recent", type=click.FloatRange(0.0), default=None, metavar="SECONDS",
              help="exit 0 at once when a prolog/epilog decision was logged this recently (default 120)")
@click.pass_obj
def healthcheck(state: State, node: str | None, skip_recent: float | None) -> None:
    """For Slurm's HealthCheckProgram: check this node, drain on failure (0 healthy, 1 unhealthy)."""
    from .healthcheck import run_healthcheck

    code = run_healthcheck(_node_name(node), lambda: state.config(for_root_hook=os.geteuid() == 0),
                           skip_recent=skip_recent)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, prog_name="slurmagent", standalone_mode=False)
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return 2
    except SlurmagentError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"slurmagent: {exc}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
