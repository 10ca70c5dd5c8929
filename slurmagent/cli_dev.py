"""`slurmagent demo`, the dev harness's one command: shown only from a checkout.

The harness (slurmagent/devtools/: a local Slurm cluster, the emulators, the scenario) is left
out of the node wheel (pyproject), so the command shows only where it is importable (a checkout:
`make demo`); a wheel's `slurmagent demo` says in one line where it lives, exit 2. Registered on
the group by cli.py."""

from __future__ import annotations

import sys
from pathlib import Path

import click

HARNESS = Path(__file__).with_name("devtools") / "__init__.py"
ELSEWHERE = "slurmagent demo: the dev harness is not in the node wheel: run it from a checkout (make demo)"


class HarnessCommand(click.Command):
    """Hidden from `--help` where the harness is absent (looked at when help is shown, not at import)."""

    @property
    def hidden(self) -> bool:
        return not HARNESS.is_file()

    @hidden.setter
    def hidden(self, _value: bool) -> None:
        pass


@click.command(cls=HarnessCommand)
@click.option("--keep", is_flag=True, help="keep the demo's work directory")
def demo(keep: bool) -> None:
    """The end-to-end scenario on a local Slurm cluster with emulated GCP (from a checkout)."""
    if not HARNESS.is_file():
        click.echo(ELSEWHERE, err=True)
        sys.exit(2)
    from .devtools.demo import run_demo  # the dev harness: only this command imports it

    sys.exit(run_demo(keep=keep))
