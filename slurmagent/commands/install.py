"""`slurmagent install [--root DIR] [--dry-run] [--uninstall]`: hooks, systemd units, a
logrotate file and a config template.

Idempotent, and an admin's edit survives: install records what it wrote (path, sha256) in
`<root>/var/lib/slurmagent/installed.json` (state/installed); a file whose content is no longer
what install last wrote is kept, and the new version is written beside it as
`<file>.slurmagent-new` (the dpkg conffile rule, for every file). Units are vendor units in
`/usr/lib/systemd/system` (admins customise them with drop-ins in `/etc/systemd/system/<unit>.d/`).
`--uninstall` first disables and stops the units the manifest lists (`systemctl disable --now`; with
`--root`, or where systemd does not run, it prints the command instead), then removes exactly what
the manifest lists (an edited file is kept and said), the directories install created when empty,
and the manifest, then reloads systemd. The paths inside the shims and units
point at this installation.

Metrics reach node_exporter by default: the config template's `[metrics] textfile` is set to a
file in node_exporter's textfile directory where the root has one (`metrics_dir`), else in a
world-readable directory of ours (the state dir is 0750 root: node_exporter, user
`prometheus`, cannot read it), and every unit may write there (`ReadWritePaths=`).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..state.config import reference_markdown
from ..errors import SlurmagentError
from ..state.build import version
from ..state.fsutil import atomic_write_text
from ..state.installed import Manifest, digest, digest_of, load as load_manifest

PLACEHOLDER_BIN = "/opt/slurmagent/venv/bin/slurmagent"
# Our shim's name in a slurm-gcp style prolog.d/ epilog.d/ (`Prolog=/slurm/custom_scripts/prolog.d/*`).
# slurmd runs a glob's scripts in reverse alphabetical order and stops at the first that fails
# (slurm.conf(5) of 24.11; measured on 22.05 too): `zz-` runs ours first, so a sick GPU is
# drained with our precise reason before slower checks (the Toolkit's a_chs_gpu_health_check.sh).
HOOK_DIR_NAME = "zz-slurmagent"
UNIT_DIR = "usr/lib/systemd/system"  # vendor units; /etc/systemd/system/<unit>.d/ is the admin's
ADMIN_UNIT_DIR = "etc/systemd/system"
NEW_SUFFIX = ".slurmagent-new"
STATE_DIR = "var/lib/slurmagent"
STATE_RW = "ReadWritePaths=/var/lib/slurmagent"  # the units' line that gets the metrics dir too
# node_exporter's textfile directories that a package creates, first found wins: Debian's and
# Ubuntu's prometheus-node-exporter (its --collector.textfile.directory default; the package's
# unit runs node_exporter as `prometheus`). We know of no packaged one on the Cluster Toolkit's
# Slurm images (node_exporter there is installed by hand, its directory chosen then): they get ours.
TEXTFILE_DIRS = ("var/lib/prometheus/node-exporter",)
# Else ours, 0755 root (only root writes it; node_exporter reads it once its
# --collector.textfile.directory points here): outside the state dir, which stays 0750.
OWN_TEXTFILE_DIR = "var/lib/slurmagent-metrics"
TEXTFILE_NAME = "slurmagent.prom"
# where data_dir finds each set of files in a checkout (the wheel has them in slurmagent/data/<name>)
CHECKOUT_DIRS = {"hooks": "hooks", "systemd": "systemd", "logrotate": "contrib/logrotate"}
SYSTEMD_RUNNING = Path("/run/systemd/system")  # sd_booted(3): systemd is this machine's init
SYSTEMCTL_TIMEOUT_S = 180.0  # `disable --now` waits for each stop (TimeoutStopSec, 90 s by default)

# Runs `systemctl ARGS...`: None when it succeeded, else why not (one line).
Systemctl = Callable[[list[str]], str | None]


class InstallError(SlurmagentError):
    """The files to install cannot be found or written."""


@dataclass(frozen=True)
class Step:
    path: Path | str  # a file, or for "ran" | "would run" | "run by hand" | "failed" a systemctl command line
    action: str  # "install" | "update" | "unchanged" | "kept" | "remove" | "obsolete" | "shadowed" | "gone" | ...
    note: str = ""


def data_dir(name: str) -> Path:
    """`hooks/`, `systemd/` or `contrib/logrotate/` from a checkout, else the wheel's copy inside
    the package (`slurmagent/data/<name>`, package data read with importlib.resources)."""
    from importlib import resources  # start-up speed: install only

    checkout = Path(__file__).resolve().parents[2] / CHECKOUT_DIRS[name]
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


def metrics_dir(root: Path) -> tuple[str, bool]:
    """(the textfile directory as seen once the root is `/`, whether it is ours): node_exporter's
    own where its package made one under `root`, else OWN_TEXTFILE_DIR."""
    for rel in TEXTFILE_DIRS:
        if (root / rel).is_dir():
            return "/" + rel, False
    return "/" + OWN_TEXTFILE_DIR, True


def config_template(textfile: str | None = None) -> str:
    """Every key commented out at its default; `textfile`: `[metrics] textfile` set to it."""
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
        if textfile and key == "metrics.textfile":
            lines[lines.index("#[metrics]")] = "[metrics]"  # uncommented: the one key install sets
            lines.append(f'textfile = "{textfile}"    # set by `slurmagent install`: node_exporter reads this directory')
            continue
        lines.append(f"#{name} = {default}    # {doc}" + (f" [{allowed}]" if allowed else ""))
    return "\n".join(lines) + "\n"


def plan(root: Path, binary: str, prolog_dir: str | None = None,
         epilog_dir: str | None = None) -> list[tuple[Path, str, int, bool]]:
    """(target, content, mode, never_overwrite) for every file to put in place."""
    textdir = metrics_dir(root)[0]
    files: list[tuple[Path, str, int, bool]] = []
    for hook in ("prolog", "epilog", "healthcheck"):
        files.append((root / "etc/slurmagent/hooks" / hook, shim_text(hook, binary), 0o755, False))
    for hook, hook_dir in (("prolog", prolog_dir), ("epilog", epilog_dir)):
        if hook_dir:  # the Toolkit layout: one script among the others of its prolog.d/
            files.append((root / hook_dir.lstrip("/") / HOOK_DIR_NAME, shim_text(hook, binary), 0o755, False))
    units = data_dir("systemd")
    for unit in sorted(units.iterdir()):
        if unit.suffix in (".service", ".timer"):
            # `-`: a node_exporter removed later leaves the unit starting (systemd skips a missing path)
            text = unit.read_text().replace(PLACEHOLDER_BIN, systemd_word(binary)).replace(
                STATE_RW + "\n", f"{STATE_RW} -{systemd_word(textdir)}\n")
            files.append((root / UNIT_DIR / unit.name, text, 0o644, False))
    files.append((root / "etc/slurmagent/config.toml", config_template(f"{textdir}/{TEXTFILE_NAME}"), 0o644, True))
    files.append((root / "etc/slurmagent/slurm.conf.example", (data_dir("hooks") / "slurm.conf.example").read_text(), 0o644, False))
    files.append((root / "etc/logrotate.d/slurmagent", (data_dir("logrotate") / "slurmagent").read_text(), 0o644, False))
    return files


def install(root: Path = Path("/"), dry_run: bool = False, binary: str | None = None,
            prolog_dir: str | None = None, epilog_dir: str | None = None) -> list[Step]:
    binary = binary or slurmagent_bin()
    if "\n" in binary or "\r" in binary:
        raise InstallError(f"cannot install: the slurmagent path {binary!r} has a line break")
    for flag, hook_dir in (("--prolog-dir", prolog_dir), ("--epilog-dir", epilog_dir)):
        if hook_dir is not None and not hook_dir.startswith("/"):
            raise InstallError(f"{flag} {hook_dir!r}: give an absolute path (slurmd runs Prolog= paths as written)")
    manifest = _manifest(root)
    steps: list[Step] = []
    try:
        steps += _state_dir(manifest, root / STATE_DIR, dry_run)
        steps += _metrics_dir(manifest, root, dry_run)
        planned = plan(root, binary, prolog_dir, epilog_dir)
        for target, content, mode, keep_mode in planned:
            steps += _put(manifest, target, content, mode, keep_mode, dry_run)
        steps += _leftovers(manifest, {t for t, *_ in planned})
        if not dry_run:
            manifest.save(version())
    except OSError as exc:  # a read-only or full root: one line, whatever the call
        raise InstallError(f"cannot write {exc.filename or root}: {exc.strerror or exc}") from None
    return steps


def run_systemctl(args: list[str]) -> str | None:
    """`systemctl ARGS...` on this machine, within SYSTEMCTL_TIMEOUT_S: None, or why it failed."""
    argv = ["systemctl", *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"no answer within {SYSTEMCTL_TIMEOUT_S:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return (lines[-1] if lines else f"exit {proc.returncode}") if proc.returncode else None


def systemctl_for(root: Path) -> Systemctl | None:
    """The live systemctl when `root` is this running system, else None: the commands are printed."""
    return run_systemctl if root == Path("/") and SYSTEMD_RUNNING.is_dir() else None


def uninstall(root: Path = Path("/"), dry_run: bool = False, systemctl: Systemctl | None = None) -> list[Step]:
    """Disable and stop the units the manifest lists (`systemctl`; None: say the command to run by
    hand), then remove what it lists: a file edited since install wrote it is kept (and said);
    then the manifest, the directories install created, where empty, and `systemctl daemon-reload`."""
    manifest = _manifest(root)
    if not manifest.path.exists():
        raise InstallError(f"nothing to uninstall: no install manifest at {manifest.path}")
    units = [Path(rel).name for rel in sorted(manifest.files) if Path(rel).parent == Path(UNIT_DIR)
             and manifest.abs(rel).exists()]
    steps = _systemctl(["disable", "--now", *units], systemctl, dry_run, "before the units go", fatal=True) if units else []
    try:
        for rel, written in sorted(manifest.files.items()):
            path = manifest.abs(rel)
            current = digest_of(path)
            if current is None:
                steps.append(Step(path, "gone"))
            elif current != written:
                steps.append(Step(path, "kept", "edited since install wrote it: remove it by hand"))
            else:
                steps.append(Step(path, "remove"))
                if not dry_run:
                    path.unlink()
        steps += _remove_textfiles(root, dry_run)
        steps.append(Step(manifest.path, "remove", "the install manifest"))
        if not dry_run:
            manifest.path.unlink()
        for rel in sorted(manifest.dirs, key=lambda d: len(Path(d).parts), reverse=True):
            path = manifest.abs(rel)
            if not path.is_dir():
                continue
            if any(path.iterdir()) and not (dry_run and _only_ours(path, steps)):
                steps.append(Step(path, "kept", "directory not empty"))
                continue
            steps.append(Step(path, "remove", "directory"))
            if not dry_run:
                path.rmdir()
    except OSError as exc:
        raise InstallError(f"cannot remove {exc.filename or root}: {exc.strerror or exc}") from None
    if units:
        steps += _systemctl(["daemon-reload"], systemctl, dry_run, "after the units went", fatal=False)
    return steps


def _remove_textfiles(root: Path, dry_run: bool) -> list[Step]:
    """The metrics file the stopped units wrote where node_exporter reads: left there, node_exporter
    would serve its last values for ever (a heartbeat that never moves, a node that looks watched)."""
    steps = []
    for rel in (*TEXTFILE_DIRS, OWN_TEXTFILE_DIR):
        path = root / rel / TEXTFILE_NAME
        if path.is_file():
            steps.append(Step(path, "remove", "the metrics node_exporter served: no series of an uninstalled agent"))
            if not dry_run:
                path.unlink()
    return steps


def _systemctl(args: list[str], systemctl: Systemctl | None, dry_run: bool, when: str, fatal: bool) -> list[Step]:
    """One systemctl step: run (a failure before anything is removed stops the uninstall), or say it."""
    line = shlex.join(["systemctl", *args])
    if systemctl is None:
        return [Step(line, "run by hand", f"on the node, {when}")]
    if dry_run:
        return [Step(line, "would run")]
    failed = systemctl(args)
    if failed and fatal:
        raise InstallError(f"`{line}` failed: {failed}; nothing removed (stop the units, then uninstall again)")
    return [Step(line, "failed", failed)] if failed else [Step(line, "ran")]


def _manifest(root: Path) -> Manifest:
    try:
        return load_manifest(root)
    except ValueError as exc:
        raise InstallError(f"{exc} (move it away to install afresh)") from None


def _only_ours(directory: Path, steps: list[Step]) -> bool:
    """In a dry run: would the directory be empty once the planned removals were done?"""
    removed = {s.path for s in steps if s.action == "remove"}
    return all(p in removed or (p.is_dir() and _only_ours(p, steps)) for p in directory.iterdir())


def _state_dir(manifest: Manifest, state: Path, dry_run: bool) -> list[Step]:
    if state.is_dir():
        return []
    if not dry_run:
        _make_dirs(manifest, state)
        state.chmod(0o750)
    return [Step(state, "install", "state dir, mode 0750")]


def _metrics_dir(manifest: Manifest, root: Path, dry_run: bool) -> list[Step]:
    textdir, ours = metrics_dir(root)
    target = root / textdir.lstrip("/")
    if not ours:
        return [Step(target, "unchanged", "node_exporter's textfile directory: [metrics] textfile goes there")]
    if target.is_dir():
        return []
    if not dry_run:
        _make_dirs(manifest, target)
        target.chmod(0o755)
    return [Step(target, "install", "metrics dir, mode 0755 (no node_exporter textfile directory found): "
                 f"run node_exporter with --collector.textfile.directory={textdir}")]


def _make_dirs(manifest: Manifest, directory: Path) -> None:
    """mkdir -p, recording each directory it creates (uninstall removes them when empty)."""
    missing = []
    d = directory
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        d.mkdir()
        manifest.created(d)


def _put(manifest: Manifest, target: Path, content: str, mode: int, keep_mode: bool, dry_run: bool) -> list[Step]:
    """One file in place, unless an admin edited it since install wrote it (it is kept and the new
    content goes beside it). `keep_mode`: the admin owns the mode (a config narrowed to 0600 is
    never widened again)."""
    current, wanted, last = digest_of(target), digest(content.encode()), manifest.written(target)
    beside = target.with_name(target.name + NEW_SUFFIX)
    if current is not None and current != wanted and current != last:  # edited (or there before any manifest)
        if last == wanted:
            return [Step(target, "kept", "edited since install wrote it")]
        if not dry_run:
            _write(manifest, beside, content, mode)
        return [Step(target, "kept", f"edited since install wrote it; the new version is beside it: {beside.name}")]
    steps = [Step(target, "unchanged" if current == wanted else "update" if current is not None else "install")]
    if not dry_run:
        if current != wanted:
            _write(manifest, target, content, mode)
        elif not keep_mode and (target.stat().st_mode & 0o777) != mode:
            os.chmod(target, mode)
        manifest.record(target, content)
    if digest_of(beside) is not None and digest_of(beside) == manifest.written(beside):  # reconciled: ours is stale
        steps.append(Step(beside, "remove", "stale: the file is current again"))
        if not dry_run:
            beside.unlink()
            manifest.forget(beside)
    return steps


def _write(manifest: Manifest, target: Path, content: str, mode: int) -> None:
    _make_dirs(manifest, target.parent)
    atomic_write_text(target, content, mode)
    manifest.record(target, content)


def _leftovers(manifest: Manifest, planned: set[Path]) -> list[Step]:
    """Files an earlier install wrote that this one does not (kept: `--uninstall` removes them),
    and full unit copies in /etc/systemd/system that hide the vendor units."""
    steps = [Step(manifest.abs(rel), "obsolete", "no longer installed; `install --uninstall` removes it")
             for rel in sorted(manifest.files)
             if manifest.abs(rel) not in planned and not rel.endswith(NEW_SUFFIX) and manifest.abs(rel).exists()]
    for target in sorted(planned):
        if target.parent == manifest.root / UNIT_DIR and (manifest.root / ADMIN_UNIT_DIR / target.name).exists():
            steps.append(Step(manifest.root / ADMIN_UNIT_DIR / target.name, "shadowed",
                              f"hides /{UNIT_DIR}/{target.name}: remove it if an older install wrote it; "
                              f"customise with a drop-in in /{ADMIN_UNIT_DIR}/{target.name}.d/"))
    return steps
