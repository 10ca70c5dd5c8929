"""`slurmagent check` (the click side): run the health checks on this node or a snapshot, or
print their catalogue (`--list`); registered on the `slurmagent` group by cli.py. Also what
every command module shares (the `--json` answer, the node a command acts on): here, not in a
module of its own, to keep the top level small (docs/dev/layout.md)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from .errors import SlurmagentError


@click.command()
@click.option("--snapshot", "snapshot_file", metavar="FILE", help="judge this replay snapshot instead of this node")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--list", "as_list", is_flag=True, help="print the catalogue of checks (name, layers, severity, "
              "default, the same check elsewhere) and exit")
@click.option("--node", metavar="NAME", help="node name (default $SLURMD_NODENAME or the host name)")
@click.pass_obj
def check(state: Any, snapshot_file: str | None, as_json: bool, as_list: bool, node: str | None) -> None:
    """Run the health checks and print findings (exit 0 healthy, 1 unhealthy)."""
    from dataclasses import asdict, replace  # start-up speed

    if as_list:
        from .core.catalogue import CATALOGUE, list_text  # start-up speed

        if as_json:
            echo_json({"checks": [asdict(spec) for spec in CATALOGUE]})
        else:
            click.echo(list_text(), nl=False)
        sys.exit(0)
    from .commands.health import evaluate  # start-up speed

    cfg = state.config()
    name = command_node(node)
    if snapshot_file:
        cfg = replace(cfg, health=replace(cfg.health, snapshot=snapshot_file, kernel_log_enabled=False))
    report = evaluate(cfg, name, commit_cursor=False)
    if as_json:
        echo_json({"node": name, **report.to_dict()})
    else:
        verdict = "healthy" if report.healthy else "UNHEALTHY"
        seen = f"{report.gpus_seen} GPU(s)" + (f", {report.expected_gpus} expected" if report.expected_gpus is not None else "")
        click.echo(f"{name}: {verdict} ({seen})")
        for f in report.findings:
            click.echo(f"  {f.severity.name:<5} {f.summary}")
        if not report.healthy:
            from .core.reasons import reason_for  # start-up speed

            click.echo(f"  drain reason: {reason_for(report)}")
    sys.exit(0 if report.healthy else 1)


def echo_json(doc: object) -> None:
    """A `--json` answer; an object says which slurmagent wrote it (`version`)."""
    from .state.build import version  # start-up speed

    if isinstance(doc, dict) and "version" not in doc:
        doc = {"version": version(), **doc}
    click.echo(json.dumps(doc, indent=1, default=str))


def command_node(node: str | None) -> str:
    from .state.host import node_name  # start-up speed
    from .slurm.commands import valid_node_name  # start-up speed

    name = node_name(node)
    if not valid_node_name(name):  # it names state paths and scontrol arguments
        raise SlurmagentError(f"not a Slurm node name: {name!r} (--node or $SLURMD_NODENAME)")
    return name

