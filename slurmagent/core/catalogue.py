"""The catalogue of health checks: every check's name, the layers it runs in, what its findings
do, its kill switch and the checkers that have the same check (docs/admin/health.md's table and
`slurmagent check --list` print it; a test keeps them equal)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

LAYERS = ("prolog", "epilog", "healthcheck", "watch", "resume")


@dataclass(frozen=True)
class CheckSpec:
    name: str                 # kebab-case, unique: the kill switch's name in [checks]
    layers: tuple[str, ...]   # where it runs by default, a subset of LAYERS
    severity: str             # "drain" or "warn": what its failing findings do (a check whose findings differ says so in `what`)
    default_on: bool          # False: runs only when named in [checks] on
    what: str                 # one line: what it looks at and what fails it
    anchors: tuple[str, ...] = ()  # the same check elsewhere: "CTK", "GCM", "CycleCloud", "NHC"


def enabled(spec_name: str, on: tuple[str, ...], off: tuple[str, ...], specs: Iterable[CheckSpec] = ()) -> bool:
    """A check runs when it is on by default (its spec in `specs`) and not in `off`, or is in `on`.
    (m39-node passes NODE_CHECKS; at the merge `specs` defaults to CATALOGUE.)"""
    if spec_name in off:
        return False
    return spec_name in on or any(s.name == spec_name and s.default_on for s in specs)
