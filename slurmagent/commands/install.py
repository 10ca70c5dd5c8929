"""`slurmagent install [--root DIR] [--dry-run]`: hooks, systemd units and a config template.

Idempotent: a file already as it should be is left alone; an edited config is never
overwritten; the paths inside the shims and units point at this installation.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ..state.config import reference_markdown
from ..errors import SlurmagentError
from ..state.fsutil import atomic_write_text

PLACEHOLDER_BIN = "/opt/slurmagent/venv/bin/slurmagent"


class InstallError(SlurmagentError):
    """The files to install cannot be found or written."""


@dataclass(frozen=True)
class Step:
    path: Path
    action: str  # "install" | "update" | "unchanged" | "kept"
    note: str = ""


def data_dir(name: str) -> Path:
    """`hooks/` or `systemd/` from a checkout, else the wheel's copy inside the package
    (`slurmagent/data/<name>`, package data read with importlib.resources)."""
    from importlib import resources  # start-up speed: install only

    checkout = Path(__file__).resolve().parents[2] / name
    if checkout.is_dir():
        return checkout
    packaged = resources.files("slurmagent").joinpath("data", name)
    if packaged.is_dir():
        return Path(str(packaged))
    raise InstallError(f"cannot find the {name}/ files of this slurmagent installation")


def slurmagent_bin() -> str:
    candidate = Path(sys.prefix) / "bin" / "slurmagent"
    return str(candidate) if candidate.exists() else PLACEHOLDER_BIN


def shim_text(hook: str, binary: str) -> str:
    """Every path quoted: `[ -x /opt/my venv/... ]` is a test error and the hook would pass unchecked."""
    return (
        "#!/bin/sh\n"
        f"# Slurm {hook.capitalize()} for slurmagent, written by `slurmagent install`.\n"
        "# slurmd runs it as root with no PATH and a fixed environment (nothing from the job).\n"
        f"[ -x {shlex.quote(binary)} ] && exec {shlex.quote(binary)} {hook}\n"
        f"/usr/bin/logger -p daemon.err -t slurmagent {shlex.quote(f'{hook}: {binary} missing; node not checked')}"
        " 2>/dev/null\n"
        "exit 0\n"
    )


def systemd_word(path: str) -> str:
    """`path` as one word of a unit's ExecStart= (quotes, and `%`/`$` that systemd would expand)."""
    if not any(c in path for c in " \t\"'\\%$;"):
        return path
    escaped = path.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def config_template() -> str:
    lines = [
        "# slurmagent configuration. Every key is optional; the values shown are the defaults.",
        "# Reference: docs/admin/configuration.md. Must be owned by root and not writable by others.",
        "",
    ]
    section = None
    for row in reference_markdown().splitlines()[2:]:
        key, default, allowed, doc = [c.strip() for c in row.strip("|").split("|", 3)]
        key, default, allowed = key.strip("`"), default.strip("`"), allowed.strip("`")
        if "." in key:
            sec, name = key.split(".", 1)
            if sec != section:
                lines += ["", f"#[{sec}]"]
                section = sec
        else:
            name = key
        lines.append(f"#{name} = {default}    # {doc}" + (f" [{allowed}]" if allowed else ""))
    return "\n".join(lines) + "\n"


def plan(root: Path, binary: str) -> list[tuple[Path, str, int, bool]]:
    """(target, content, mode, never_overwrite) for every file to put in place."""
    files: list[tuple[Path, str, int, bool]] = []
    for hook in ("prolog", "epilog", "healthcheck"):
        files.append((root / "etc/slurmagent/hooks" / hook, shim_text(hook, binary), 0o755, False))
    units = data_dir("systemd")
    for unit in sorted(units.iterdir()):
        if unit.suffix in (".service", ".timer"):
            text = unit.read_text().replace(PLACEHOLDER_BIN, systemd_word(binary))
            files.append((root / "etc/systemd/system" / unit.name, text, 0o644, False))
    files.append((root / "etc/slurmagent/config.toml", config_template(), 0o644, True))
    files.append((root / "etc/slurmagent/slurm.conf.example", (data_dir("hooks") / "slurm.conf.example").read_text(), 0o644, False))
    return files


def install(root: Path = Path("/"), dry_run: bool = False, binary: str | None = None) -> list[Step]:
    binary = binary or slurmagent_bin()
    if "\n" in binary or "\r" in binary:
        raise InstallError(f"cannot install: the slurmagent path {binary!r} has a line break")
    steps: list[Step] = []
    for target, content, mode, keep_existing in plan(root, binary):
        try:
            steps.append(_put(target, content, mode, keep_existing, dry_run))
        except OSError as exc:  # a read-only or full root: one line, whatever the call
            raise InstallError(f"cannot write {exc.filename or target}: {exc.strerror or exc}") from None
    state = root / "var/lib/slurmagent"
    if not state.is_dir():
        steps.append(Step(state, "install", "state dir, mode 0750"))
        if not dry_run:
            try:
                state.mkdir(parents=True, exist_ok=True)
                state.chmod(0o750)
            except OSError as exc:
                raise InstallError(f"cannot create {exc.filename or state}: {exc.strerror or exc}") from None
    return steps


def _put(target: Path, content: str, mode: int, keep_existing: bool, dry_run: bool) -> Step:
    """One file in place. A file the admin owns (the config) keeps its content and its mode:
    a config narrowed to 0600 is never widened again."""
    current = target.read_text() if target.exists() else None
    if current is not None and keep_existing:
        if current == content:
            return Step(target, "unchanged")
        return Step(target, "kept", "exists (edited config is never overwritten)")
    if current == content:
        if not dry_run and (target.stat().st_mode & 0o777) != mode:
            os.chmod(target, mode)
        return Step(target, "unchanged")
    if not dry_run:
        atomic_write_text(target, content, mode)
    return Step(target, "update" if current is not None else "install")
