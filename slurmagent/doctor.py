"""`slurmagent doctor`: each check is a pass/fail line with the fix, never an exception."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import config as config_mod
from .errors import SlurmagentError
from .slurm import conf_value, read_conf_lines, slurm_conf_path


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def slurm_conf_results(conf: Path) -> list[Result]:
    """The slurm.conf lines slurmagent's hooks rely on (see hooks/slurm.conf.example)."""
    lines = read_conf_lines(conf)
    if not lines:
        return [Result("slurm.conf", False, f"cannot read {conf}", "set SLURM_CONF or [slurm] conf")]
    out = []
    for key in ("Prolog", "Epilog"):
        value = conf_value(lines, key) or ""
        ok = "slurmagent" in value
        out.append(Result(f"slurm.conf {key}", ok, value or "not set",
                          f"{key}=/etc/slurmagent/hooks/{key.lower()}"))
    flags = (conf_value(lines, "PrologFlags") or "").lower().split(",")
    out.append(Result("slurm.conf PrologFlags", "alloc" in flags, ",".join(f for f in flags if f) or "not set",
                      "PrologFlags=Alloc (check the node when the job is allocated, before it starts)"))
    params = (conf_value(lines, "SchedulerParameters") or "").split(",")
    out.append(Result("slurm.conf nohold_on_prolog_fail", "nohold_on_prolog_fail" in params,
                      "set" if "nohold_on_prolog_fail" in params else "missing: jobs would be requeued HELD",
                      "add nohold_on_prolog_fail to SchedulerParameters"))
    timeout = conf_value(lines, "PrologEpilogTimeout")
    out.append(Result("slurm.conf PrologEpilogTimeout", bool(timeout), timeout or "not set (hooks may hang forever)",
                      "PrologEpilogTimeout=120"))
    return out


def run_doctor(config_path: str | None) -> list[Result]:
    results: list[Result] = []
    path, _ = config_mod.config_path(config_path)
    try:
        cfg = config_mod.load(config_path, for_root_hook=True)
        results.append(Result("config", True, f"{cfg.source} valid, root-owned, not writable by others"))
    except SlurmagentError as exc:
        results.append(Result("config", False, str(exc), f"fix {path} (see README, Configuration)"))
        try:
            cfg = config_mod.load(config_path)
        except SlurmagentError:
            cfg = config_mod.Config()
    results.extend(slurm_conf_results(slurm_conf_path(cfg.slurm.conf)))
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
    results.append(_gpu_result(cfg, node))
    results.append(_state_dir_result(cfg.state_path(node)))
    return results


def _gpu_result(cfg: config_mod.Config, node: str) -> Result:
    from .health import expected_gpus, read_snapshot

    try:
        snap = read_snapshot(cfg, node)
    except SlurmagentError as exc:
        return Result("GPUs", False, str(exc), "check the NVIDIA driver (nvidia-smi) or [health] snapshot")
    if snap.nvml_error:
        return Result("GPUs", False, f"NVML cannot start: {snap.nvml_error}", "install/load the NVIDIA driver")
    expected = expected_gpus(cfg, node)
    ok = expected is None or len(snap.gpus) >= expected
    detail = f"{len(snap.gpus)} GPU(s) seen" + (f", {expected} expected" if expected is not None else "")
    return Result("GPUs", ok, detail, "set Gres=gpu:N for this node or [health] expected_gpus")


def _state_dir_result(state_dir: Path) -> Result:
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=state_dir, prefix=".doctor."):
            pass
        return Result("state dir", True, f"{state_dir} writable")
    except OSError as exc:
        return Result("state dir", False, f"{state_dir}: {exc.strerror}", f"mkdir -p {state_dir} (as root)")
