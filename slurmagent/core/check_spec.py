"""What a health check is in the catalogue (core/catalogue.py): its own module so the GPU and
the node checks' specs (core/node_catalogue.py) share it without an import circle."""

from __future__ import annotations

from dataclasses import dataclass

LAYERS = ("prolog", "epilog", "healthcheck", "watch", "resume")


@dataclass(frozen=True)
class CheckSpec:
    name: str                 # kebab-case, unique: the kill switch's name in [checks]
    layers: tuple[str, ...]   # where it runs by default, a subset of LAYERS
    severity: str             # "drain" or "warn": what its failing findings do (a check whose findings differ says so in `what`)
    default_on: bool          # False: runs only when named in [checks] on
    what: str                 # one line: what it looks at and what fails it
    anchors: tuple[str, ...] = ()  # the same check elsewhere: "CTK", "GCM", "CycleCloud", "NHC"
