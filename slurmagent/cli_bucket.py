"""The commands that read a checkpoint prefix on Cloud Storage (the click side): `ckpt ls|gc`
(its commits and their clean-up, commands/ckpt.py) and `report` (its goodput ledger,
commands/report.py). Registered on the `slurmagent` group by cli.py."""

from __future__ import annotations

import sys
from typing import Any

import click


@click.group()
def ckpt() -> None:
    """A checkpoint prefix on Cloud Storage: its commits, its clean-up."""


def _remote_arg(remote: str) -> str:
    if not remote.startswith("gs://"):
        raise click.BadParameter(f"{remote!r} is not a gs://BUCKET/PREFIX", param_hint="--remote")
    return remote


@ckpt.command("ls")
@click.option("--remote", required=True, metavar="gs://B/P", help="the checkpoint prefix")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_obj
def ckpt_ls(state: Any, remote: str, as_json: bool) -> None:
    """List the prefix's commits: attempt, time, files, bytes (oldest first)."""
    from .commands.ckpt import run_ls  # start-up speed

    sys.exit(run_ls(state.config(), _remote_arg(remote), as_json, sys.stdout))


@ckpt.command("gc")
@click.option("--remote", required=True, metavar="gs://B/P", help="the checkpoint prefix")
@click.option("--dry-run", is_flag=True, help="say what would be deleted, delete nothing")
@click.option("--keep", type=click.IntRange(min=1), metavar="N", help="commits to keep (default [checkpoint] keep_commits)")
@click.option("--grace-s", type=click.FloatRange(min=0), metavar="S",
              help="grace period in seconds (default [checkpoint] gc_grace_s)")
@click.pass_obj
def ckpt_gc(state: Any, remote: str, dry_run: bool, keep: int | None, grace_s: float | None) -> None:
    """Delete the objects no kept commit references, as a job does after each commit."""
    from .commands.ckpt import run_gc  # start-up speed

    sys.exit(run_gc(state.config(), _remote_arg(remote), dry_run, keep, grace_s, sys.stdout))


@click.command()
@click.option("--remote", metavar="gs://B/P", help="the checkpoint prefix (default [checkpoint] remote): its jobs' ledgers")
@click.option("--job", "job_id", metavar="ID", help="only this job")
@click.option("--since", metavar="DURATION", help="only jobs active within this long (90m, 12h, 7d)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--html", "html_file", metavar="FILE", help="also write one self-contained HTML page")
@click.option("--state-dir", metavar="DIR", help="the repair loop's state dir: faults per node, lemons "
              "(default: this node's, when it holds a repair history)")
@click.option("--decision-log", "decision_logs", multiple=True, metavar="FILE",
              help="a node's decision log (repeatable): the root side's events per job (default: this node's)")
@click.pass_obj
def report(state: Any, remote: str | None, job_id: str | None, since: str | None, as_json: bool,
           html_file: str | None, state_dir: str | None, decision_logs: tuple[str, ...]) -> None:
    """The goodput ledger: per job its attempts and interruptions, ETTR, GPU-hours lost by cause."""
    from .commands.report import run_report  # start-up speed

    sys.exit(run_report(state.config(), sys.stdout, remote=remote, job=job_id, since=since, as_json=as_json,
                        html=html_file, state_dir=state_dir, decision_logs=decision_logs))
