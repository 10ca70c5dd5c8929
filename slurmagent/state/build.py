"""Which slurmagent runs: the version of the installed distribution, read from its metadata.

pyproject.toml's `version` is the only literal. `importlib.metadata` costs about as much to
import as the whole healthy prolog (the decision log of every prolog carries the version), so
the `slurmagent-<version>.dist-info` is looked up by hand: beside the package first (where pip
put this very code), then on sys.path as importlib.metadata would (an editable install); only
then `importlib.metadata` itself, and "0+unknown" without any. Read once per process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

UNKNOWN = "0+unknown"
_cached: str | None = None


def version() -> str:
    global _cached
    if _cached is None:
        package_site = str(Path(__file__).resolve().parents[2])
        _cached = next(filter(None, map(_dist_info_version, [package_site, *sys.path])), None)
        _cached = _cached or _from_importlib() or UNKNOWN
    return _cached


def _dist_info_version(site: str) -> str | None:
    """`Version:` of the one `slurmagent-*.dist-info` in `site`, else None."""
    try:
        infos = [e.name for e in os.scandir(site or ".")
                 if e.name.startswith("slurmagent-") and e.name.endswith(".dist-info")]
    except OSError:
        return None
    if len(infos) != 1:  # none (a checkout) or a half-cleaned upgrade: let importlib.metadata choose
        return None
    site = Path(site or ".")
    try:
        with open(site / infos[0] / "METADATA", encoding="utf-8") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.partition(":")[2].strip() or None
                if not line.strip():  # end of the headers
                    break
    except OSError:
        pass
    return None


def _from_importlib() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("slurmagent")
    except metadata.PackageNotFoundError:
        return None
