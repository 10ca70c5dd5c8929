"""`slurmagent ckpt ls|gc`: a checkpoint prefix's commits and its clean-up (the click side;
the work is commands/ckpt.py). Registered on the `slurmagent` group by cli.py."""

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
