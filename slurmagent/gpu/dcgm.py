"""`dcgmi diag -r N -j` under a deadline: DCGM's own diagnostics, where DCGM runs.

DCGM absent (no `dcgmi`) or its host engine down is "not available", never a failure: the
caller says it once. The run's JSON is parsed by core/node_checks.parse_diag.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from ..core.node_checks import DiagResult, parse_diag

# What dcgmi prints when nv-hostengine does not answer (DCGM 3.x/4.x):
# "Error: unable to establish a connection to the specified host: localhost"
# "Error: Unable to connect to host engine. Host engine connection invalid/disconnected."
ENGINE_DOWN = re.compile(r"connect(ion)? to (the specified host|host engine)|host engine connection", re.I)


@dataclass(frozen=True)
class DiagRun:
    level: int
    result: DiagResult | None = None
    unavailable: str = ""  # why DCGM cannot run here: said, never a failure
    error: str = ""  # it ran but gave no verdict (timeout, no JSON): a warning


def installed(dcgmi: str) -> bool:
    return shutil.which(dcgmi) is not None


def run_diag(dcgmi: str, level: int, timeout_s: float) -> DiagRun:
    """One `dcgmi diag -r level -j`, killed past `timeout_s`."""
    exe = shutil.which(dcgmi)
    if exe is None:
        return DiagRun(level, unavailable=f"{dcgmi} not found (DCGM not installed)")
    argv = [exe, "diag", "-r", str(level), "-j"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return DiagRun(level, error=f"`dcgmi diag -r {level}` did not finish within {timeout_s:g} s")
    except OSError as exc:
        return DiagRun(level, unavailable=f"cannot run {exe}: {exc.strerror or exc}")
    out = proc.stdout + proc.stderr
    try:
        result = parse_diag(proc.stdout)
    except ValueError:
        first = next((line.strip() for line in out.splitlines() if line.strip()), "no output")
        if ENGINE_DOWN.search(out):
            return DiagRun(level, unavailable=f"DCGM host engine not running ({first[:120]})")
        return DiagRun(level, error=f"`dcgmi diag -r {level}` gave no JSON (exit {proc.returncode}: {first[:120]})")
    return DiagRun(level, result=result)
