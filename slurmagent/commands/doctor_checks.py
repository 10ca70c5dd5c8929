"""`slurmagent doctor`'s result line and the checks of what an admin must see running: the
slurm.conf the hooks read (the configless cache included), the controller, the systemd units
(`slurmagent-watch`, the expiry timer and its last run) and the metrics file node_exporter reads.

Each check gives `Result` lines and never raises; every command it runs has a deadline.
`systemctl` is found on PATH (tests put a fake there); where systemd does not run (a container,
no systemctl) the unit lines are skipped, never failed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..errors import SlurmagentError
from ..slurm import env as slurm_env
from ..slurm.commands import CONF_SEARCH, Slurm, conf_candidates, run_argv
from ..slurm.features import SlurmFeatures, controller_address, doctor_line
from ..state.fsutil import root_dir_problem

CALL_TIMEOUT_S = 4.0  # one scontrol / systemctl / HTTP request
SLURM_CONTROLLER = "slurm controller"
SLURM_FEATURES = "slurm 25.11+ features"
FIX_CONTROLLER = ("start slurmctld (systemctl status slurmctld) or let this host reach SlurmctldHost:SlurmctldPort "
                  "(scontrol ping says which)")
FIX_SLURM_METRICS = ("let this host reach SlurmctldPort (the endpoint answers there), or drop MetricsType; "
                     "see docs/admin/observability.md")
WATCH_UNIT, EXPIRY_TIMER, EXPIRY_SERVICE = "slurmagent-watch.service", "slurmagent-expiry.timer", "slurmagent-expiry.service"
UNIT_PROPERTIES = ("LoadState", "UnitFileState", "ActiveState", "SubState", "Result", "ExecMainStatus",
                   "ExecMainExitTimestamp")
NO_SYSTEMD = ("not been booted with systemd", "failed to connect to bus", "host is down", "no such file or directory")


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False  # not applicable here (e.g. no bucket configured): never a failure
    config_error: bool = False  # the config file itself is missing or invalid: exit 2
    unreachable: bool = False  # what it checks gave no answer (network, timeout, 5xx): exit 3

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "ok": self.ok, "status": self.mark.lower(), "detail": self.detail,
                "fix": self.fix if not self.ok else ""}

    @property
    def mark(self) -> str:
        return "skip" if self.skipped else ("ok" if self.ok else "FAIL")


def skip(name: str, detail: str) -> Result:
    return Result(name, True, detail, skipped=True)


def one_line(text: object, limit: int = 300) -> str:
    lines = str(text).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --- slurm.conf, found as the hooks find it -----------------------------------------------------


def find_slurm_conf(configured: str = "", env: Mapping[str, str] = os.environ,
                    search: tuple[Path, ...] = CONF_SEARCH) -> tuple[Path | None, list[Path]]:
    """The slurm.conf the hooks read: `[slurm] conf`, $SLURM_CONF, the configless cache (where
    Slurm links it, then the default SlurmdSpoolDir's), /etc/slurm: the first readable one, and
    every candidate tried (for the message when none is)."""
    tried = conf_candidates(configured, env, search)
    return next((p for p in tried if os.path.isfile(p) and os.access(p, os.R_OK)), None), tried


# --- the controller -----------------------------------------------------------------------------


def controller_results(scontrol: str, timeout_s: float, conf: Path | None) -> list[Result]:
    """One `scontrol show config` (with the slurm.conf found here as SLURM_CONF unless one is
    set, as a configless node's Slurm clients find it): the controller's line (no answer: exit
    3, as documented), then what Slurm 25.11+ does for slurmagent (slurm/features.py)."""
    env = dict(os.environ)
    if conf is not None:
        env.setdefault(slurm_env.CONF, str(conf))
    slurm = Slurm(scontrol, timeout_s, runner=lambda argv, timeout: run_argv(argv, timeout, env=env))
    try:
        config = slurm.show_config(min(timeout_s, CALL_TIMEOUT_S))
    except SlurmagentError as exc:
        why = one_line(exc)
        if "cannot run" in why:  # no scontrol here: nothing of Slurm can work on this host
            return [Result(SLURM_CONTROLLER, False, why, "install the Slurm client or set [slurm] scontrol"),
                    skip(SLURM_FEATURES, "not asked: no scontrol")]
        return [Result(SLURM_CONTROLLER, False, f"slurmctld did not answer `scontrol show config`: {why}",
                       FIX_CONTROLLER, unreachable=True),
                skip(SLURM_FEATURES, "not asked: the controller did not answer")]
    features = SlurmFeatures.from_config(config)
    head = Result(SLURM_CONTROLLER, True, f"slurmctld {controller_address(config)} answers "
                                          f"(Slurm {features.version_text})")
    url = f"http://{controller_address(config)}:{features.ctld_port}/metrics"
    answer = get_fails(url, CALL_TIMEOUT_S) if features.openmetrics and features.ctld_port else None
    ok, detail, skipped = doctor_line(features, url, answer)
    return [head, Result(SLURM_FEATURES, ok, one_line(detail), "" if ok else FIX_SLURM_METRICS, skipped=skipped)]


def http_get(url: str, timeout_s: float):
    """GET `url` directly: an `http_proxy` in root's environment must not stand between doctor
    and slurmctld or node_exporter (a proxy answers for a controller that is down)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=timeout_s)


def get_fails(url: str, timeout_s: float) -> str | None:
    """None when `GET url` answers (any status but a 5xx: 401/403 is a restricted endpoint), else why not."""
    try:
        with http_get(url, timeout_s):
            return None
    except urllib.error.HTTPError as exc:
        return None if exc.code < 500 else f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


# --- systemd units ------------------------------------------------------------------------------


def unit_results(systemctl: str | None = None) -> list[Result]:
    """`slurmagent-watch` enabled and running; the expiry timer enabled and active, and its last
    run's result (a failed run: expiry protection is off, `expiry-watch` exits 1 for that)."""
    exe = systemctl or shutil.which("systemctl")
    names = ("slurmagent-watch", "expiry timer")
    if not exe:
        return [skip(n, "no systemctl here: the units are not checked") for n in names]
    try:
        watch = unit_state(exe, WATCH_UNIT)
        timer = unit_state(exe, EXPIRY_TIMER)
        service = unit_state(exe, EXPIRY_SERVICE)
    except OSError as exc:
        why = str(exc)
        if any(s in why.lower() for s in NO_SYSTEMD):
            return [skip(n, f"systemd is not running here ({one_line(why, 100)})") for n in names]
        return [Result(n, False, f"systemctl: {one_line(why, 200)}", "check systemd (systemctl status)") for n in names]
    return [_watch_result(watch), _timer_result(timer, service)]


def unit_state(systemctl: str, unit: str) -> dict[str, str]:
    """`systemctl show UNIT -p ...` as a dict; OSError when systemctl fails or hangs."""
    argv = [systemctl, "show", unit, *(f"--property={p}" for p in UNIT_PROPERTIES)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise OSError(f"systemctl show {unit} timed out after {CALL_TIMEOUT_S:g} s") from None
    if proc.returncode != 0:
        raise OSError((proc.stderr or proc.stdout).strip() or f"systemctl show {unit}: exit {proc.returncode}")
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def _installed(unit: str, state: dict[str, str]) -> str | None:
    if state.get("LoadState") in (None, "", "not-found"):
        return f"{unit} is not installed"
    return None


def _watch_result(s: dict[str, str]) -> Result:
    name, fix = "slurmagent-watch", "systemctl enable --now slurmagent-watch (journalctl -u slurmagent-watch says why)"
    missing = _installed(WATCH_UNIT, s)
    if missing:
        return Result(name, False, missing, "slurmagent install, then systemctl enable --now slurmagent-watch")
    enabled = s.get("UnitFileState", "") in ("enabled", "enabled-runtime", "static", "generated", "alias")
    active = s.get("ActiveState") == "active"
    detail = f"{s.get('UnitFileState') or '?'}, {s.get('ActiveState') or '?'} ({s.get('SubState') or '?'})"
    if not enabled:
        detail += ": will not start at boot"
    elif not active:
        detail += ": XID and GPU-loss drains do not happen while it is down"
    return Result(name, enabled and active, detail, fix)


def _timer_result(timer: dict[str, str], service: dict[str, str]) -> Result:
    name, fix = "expiry timer", "systemctl enable --now slurmagent-expiry.timer"
    missing = _installed(EXPIRY_TIMER, timer)
    if missing:
        return Result(name, False, missing, "slurmagent install, then systemctl enable --now slurmagent-expiry.timer")
    enabled = timer.get("UnitFileState", "") in ("enabled", "enabled-runtime", "static", "generated")
    active = timer.get("ActiveState") == "active"
    detail = f"timer {timer.get('UnitFileState') or '?'}, {timer.get('ActiveState') or '?'}"
    if not (enabled and active):
        return Result(name, False, detail + ": nothing drains or flushes ahead of the VM's end", fix)
    result, status = service.get("Result", ""), service.get("ExecMainStatus", "")
    if not service.get("ExecMainExitTimestamp"):
        return Result(name, True, detail + "; not run yet")
    if result != "success":
        return Result(name, False, f"{detail}; last run failed ({result}, exit {status or '?'}): expiry protection "
                                   "may be off", "journalctl -u slurmagent-expiry (a 403: grant compute.instances.get "
                                                 "or set [expiry] compute_api = false; see docs/admin/expiry.md)")
    return Result(name, True, f"{detail}; last run ok ({service['ExecMainExitTimestamp']})")


# --- the metrics file node_exporter reads -------------------------------------------------------


NODE_EXPORTER_URL = "http://127.0.0.1:9100/metrics"  # node_exporter's default listen address


def metrics_file_result(textfile: Path, exporter_url: str = NODE_EXPORTER_URL) -> Result:
    """The file's modes (`textfile_modes`), then, where node_exporter answers on this host, what
    it says: `node_textfile_scrape_error` and whether it read this file (`node_textfile_mtime_seconds`)."""
    modes = textfile_modes(textfile)
    if not modes.ok or modes.skipped:
        return modes
    seen = exporter_view(exporter_url, textfile)
    if seen is None:
        return Result(modes.name, True, f"{modes.detail} (no node_exporter answers at {exporter_url})")
    return seen


def exporter_view(url: str, textfile: Path) -> Result | None:
    """What node_exporter's own metrics say of the textfile; None when it does not answer."""
    name = "metrics file"
    try:
        with http_get(url, CALL_TIMEOUT_S) as resp:
            lines = resp.read(16 * 1024 * 1024).decode("utf-8", "replace").splitlines()
    except (OSError, ValueError):
        return None
    if not any(line.startswith("node_textfile_scrape_error") for line in lines):
        return Result(name, False, f"node_exporter at {url} runs no textfile collector",
                      f"start it with --collector.textfile.directory={textfile.parent}")
    failed = any(line.startswith("node_textfile_scrape_error ") and line.split()[-1] not in ("0", "0.0")
                 for line in lines)
    read = any(line.startswith("node_textfile_mtime_seconds{") and
               (f'file="{textfile}"' in line or f'file="{textfile.name}"' in line) for line in lines)
    if failed:
        return Result(name, False, f"node_exporter at {url}: node_textfile_scrape_error 1 (a file in its textfile "
                                   "directory cannot be read or parsed)", "journalctl -u node_exporter says which")
    if not read:
        return Result(name, False, f"node_exporter at {url} does not read {textfile} (not in its textfile directory)",
                      f"set [metrics] textfile to a file in node_exporter's --collector.textfile.directory, or point "
                      f"that flag at {textfile.parent}")
    return Result(name, True, f"node_exporter at {url} reads {textfile}")


def textfile_modes(textfile: Path) -> Result:
    """node_exporter (its own user) lists the textfile directory and reads the file: the
    directory must be listable by others, the file readable by them (a root-only state dir is
    the usual miss; the system directories above it are taken as open). Judged from the modes,
    nothing written."""
    name = "metrics file"
    fix = (f"chmod o+rx {textfile.parent} (and o+x above it), or set [metrics] textfile to a file in "
           "node_exporter's --collector.textfile.directory; see docs/admin/observability.md")
    if not textfile.parent.is_dir():
        return Result(name, True, f"{textfile.parent} does not exist yet: the first check writes {textfile.name} there",
                      skipped=True)
    why = root_dir_problem(os.lstat(textfile.parent)) if os.geteuid() == 0 else None
    if why:  # root's writes go only into its own directory (state/fsutil.open_root_dir)
        return Result(name, False, f"root writes no metrics into {textfile.parent}: {why}",
                      f"chown root:root {textfile.parent} && chmod 0755 {textfile.parent}, or set [metrics] textfile "
                      "to a file in a directory only root can write; see docs/admin/observability.md")
    mode = os.stat(textfile.parent).st_mode
    if (mode & (stat.S_IROTH | stat.S_IXOTH)) != (stat.S_IROTH | stat.S_IXOTH):
        return Result(name, False, f"node_exporter cannot list {textfile.parent} (mode {stat.S_IMODE(mode):o})", fix)
    if not textfile.exists():
        return Result(name, True, f"{textfile} not written yet (the first check writes it); its directory is readable",
                      skipped=True)
    fmode = os.stat(textfile).st_mode
    if not fmode & stat.S_IROTH:
        return Result(name, False, f"node_exporter cannot read {textfile} (mode {stat.S_IMODE(fmode):o})",
                      f"chmod o+r {textfile}")
    return Result(name, True, f"{textfile} readable by node_exporter")
