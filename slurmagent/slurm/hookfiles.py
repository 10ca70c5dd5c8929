"""What a slurm.conf Prolog/Epilog/HealthCheckProgram value runs, and whether slurmagent's shim is
among it: judged from the files (a glob such as slurm-gcp's `/slurm/custom_scripts/prolog.d/*`, a
path relative to slurm.conf), never from the value's wording.

slurmd runs a glob's matches in reverse alphabetical order and stops at the first that fails
(slurm.conf(5), Slurm 24.11; measured on 22.05 too); Slurm 24.11 also allows several Prolog= lines.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

HOOKS = ("prolog", "epilog", "healthcheck")
GLOB_CHARS = "*?["
_EXEC = re.compile(r"^\s*(?:\[[^\]]*\]\s*&&\s*)?exec\s+(?P<cmd>.+?)\s*$")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False


@dataclass(frozen=True)
class Shim:
    path: Path
    hook: str  # prolog | epilog | healthcheck: the subcommand it execs
    program: str  # what it execs
    runnable: bool  # that program exists and is executable


def conf_values(lines: list[str], key: str) -> list[str]:
    """Every value of a slurm.conf key outside NodeName/PartitionName lines, in order."""
    out = []
    for line in lines:
        for token in line.split():
            k, eq, value = token.partition("=")
            if eq and k.lower() in ("nodename", "partitionname"):
                break
            if eq and k.lower() == key.lower():
                out.append(value)
    return out


def scripts(value: str, conf_dir: Path) -> list[Path]:
    """The programs slurmd runs for one value, in its order; a relative path is beside slurm.conf."""
    path = value if value.startswith("/") else str(conf_dir / value)
    if any(c in path for c in GLOB_CHARS):
        return [Path(p) for p in sorted(glob.glob(path), reverse=True)]
    return [Path(path)]


def read_shim(path: Path) -> Shim | None:
    """A slurmagent shim: a line `exec ...slurmagent... HOOK` (the one `install` writes, or an
    admin's two-liner). None for any other file."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(65536)
    except OSError:
        return None
    for line in text.splitlines():
        m = _EXEC.match(line)
        if not m:
            continue
        try:
            words = shlex.split(m["cmd"])
        except ValueError:
            continue
        if len(words) >= 2 and words[-1] in HOOKS and any("slurmagent" in w for w in words[:-1]):
            program = words[0]
            return Shim(path, words[-1], program, os.path.isfile(program) and os.access(program, os.X_OK))
    return None


def _install_fix(key: str) -> str:
    hook = key.lower()
    return (f"{key}=/etc/slurmagent/hooks/{hook}, or with a {key}=DIR/* glob (Cluster Toolkit: "
            f"/slurm/custom_scripts/{hook}.d/*): slurmagent install --{hook}-dir DIR")


def _shim_verdict(key: str, shim: Shim, how: str) -> Verdict:
    if not os.access(shim.path, os.X_OK):
        return Verdict(False, f"{how}{shim.path} is not executable: slurmd cannot run it", f"chmod 755 {shim.path}")
    if not shim.runnable:
        return Verdict(False, f"{how}{shim.path} runs {shim.program}, which is missing: the node is not checked",
                       "reinstall slurmagent, then `slurmagent install` (the shims point at it)")
    return Verdict(True, f"{how}{shim.path} (runs {shim.program} {shim.hook})")


def hook_verdict(key: str, values: list[str], conf_dir: Path) -> Verdict:
    """Prolog or Epilog: does one of the programs it runs exec `slurmagent prolog|epilog`?"""
    hook = key.lower()
    if not values:
        return Verdict(False, "not set", _install_fix(key))
    problems, found = [], []
    for value in values:
        if os.path.isdir(value) and not any(c in value for c in GLOB_CHARS):
            problems.append(f"{value} is a directory: slurmd runs programs, not a directory")
            fix = f"{key}={value.rstrip('/')}/*"
            inside = [s for s in (read_shim(p) for p in scripts(value.rstrip("/") + "/*", conf_dir)) if s]
            return Verdict(False, "; ".join(problems) + (f" (it holds {inside[0].path})" if inside else ""), fix)
        paths = [p for p in scripts(value, conf_dir) if p.is_file()]
        if not paths:
            problems.append(f"{value} matches no file")
            continue
        for p in paths:
            shim = read_shim(p)
            if shim is not None:
                found.append((value, len(paths), shim))
    ours = [(v, n, s) for v, n, s in found if s.hook == hook]
    if ours:
        value, n, shim = ours[0]
        how = f"{value} -> " if value != str(shim.path) else ""
        how += f"{n} script(s), ours " if n > 1 else ""
        return _shim_verdict(key, shim, how)
    if found:
        wrong = found[0][2]
        return Verdict(False, f"{wrong.path} is slurmagent's {wrong.hook} shim, not its {hook}", _install_fix(key))
    listed = ", ".join(values)
    return Verdict(False, "; ".join(problems) or f"{listed}: no program there is slurmagent's {hook} shim",
                   _install_fix(key))


def healthcheck_verdict(value: str | None, conf_dir: Path) -> Verdict:
    """HealthCheckProgram: optional; when it is our shim, it must run; another program is its owner's."""
    if not value:
        return Verdict(True, "not set: no Slurm health check between jobs (`slurmagent watch` still drains)",
                       skipped=True)
    path = scripts(value, conf_dir)[0]
    if not path.is_file() or not os.access(path, os.X_OK):
        return Verdict(False, f"{value}: no such executable file (slurmd's health check fails)",
                       "HealthCheckProgram=/etc/slurmagent/hooks/healthcheck (see hooks/slurm.conf.example)")
    shim = read_shim(path)
    if shim is None:
        return Verdict(True, f"{value} is not slurmagent's (its owner's checks run; `slurmagent watch` "
                             "still drains between jobs)", skipped=True)
    if shim.hook != "healthcheck":
        return Verdict(False, f"{value} is slurmagent's {shim.hook} shim, not its healthcheck",
                       "HealthCheckProgram=/etc/slurmagent/hooks/healthcheck")
    return _shim_verdict("HealthCheckProgram", shim, "")
