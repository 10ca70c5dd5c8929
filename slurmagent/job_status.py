"""`slurmagent status --job ID`: a job's checkpoint as its owner sees it.

The bucket's committed manifest is the truth and readable from anywhere (a login node sees no
node-local checkpoint directory); the wrapper's status record (`ckpt_report`), when this node
holds it, adds the running attempt's view: its last sync, the lag, held-back units, and the
remote the wrapper really uses (`--remote`, or the per-job default). The record is the job
owner's file: it is shown and its remote is read, nothing is done on its word.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Callable, Mapping

from .ckpt_report import age_s, human_bytes, manifest_summary, read_record, record_path
from .config import Config
from .errors import SlurmagentError
from .slurm import Slurm
from .timefmt import human_short

UID_RE = re.compile(r"\((\d+)\)$")  # scontrol's UserId=alice(1000)


def job_owner_uid(raw: Mapping[str, str] | None) -> int | None:
    m = UID_RE.search((raw or {}).get("UserId", ""))
    return int(m.group(1)) if m else None


def collect_job_status(cfg: Config, job_id: str, *, remote: str | None = None, slurm: Slurm | None = None,
                       env: Mapping[str, str] | None = None, store_factory: Callable[[str], Any] | None = None,
                       clock: Callable[[], float] = time.time) -> dict[str, Any]:
    env = os.environ if env is None else env
    slurm = slurm or Slurm.from_config(cfg)
    st: dict[str, Any] = {"job": job_id, "time": clock(), "slurm": None, "slurm_error": None, "record": None,
                          "remote": remote, "commit": None, "remote_error": None}
    uid = os.geteuid()
    try:
        job = slurm.job(job_id)
        if job is None:
            st["slurm_error"] = f"no job {job_id} (finished long ago, or never existed)"
        else:
            st["slurm"] = {"state": job.state, "restarts": job.restarts, "nodes": job.node_list,
                           "user": (job.raw or {}).get("UserId", "")}
            uid = job_owner_uid(job.raw) if job_owner_uid(job.raw) is not None else uid
    except SlurmagentError as exc:
        st["slurm_error"] = str(exc)
    record = read_record(record_path(env, uid, job_id))
    if record is not None and str(record.get("job")) == job_id:
        st["record"] = record
    if not st["remote"]:
        if st["record"] and isinstance(st["record"].get("remote"), str) and st["record"]["remote"].startswith("gs://"):
            st["remote"] = st["record"]["remote"]
        elif cfg.checkpoint.remote:
            st["remote"] = cfg.checkpoint.remote.rstrip("/") + "/" + job_id  # the wrapper's default prefix
    if st["remote"]:
        try:
            if store_factory is None:
                from .gcp.storage import GcsCheckpointStore  # google only here: start-up speed

                store_factory = GcsCheckpointStore
            manifest = store_factory(st["remote"]).latest_manifest(deadline_s=30.0)
            if manifest is not None:
                st["commit"] = {**manifest_summary(manifest), "age_s": age_s(manifest.created, clock())}
        except Exception as exc:  # noqa: BLE001 - one line, the rest is still worth showing
            st["remote_error"] = (str(exc).splitlines() or [type(exc).__name__])[0]
    return st


def format_job_status(st: dict[str, Any]) -> str:
    lines = []
    s = st["slurm"]
    if s:
        lines.append(f"job {st['job']}: {s['state']}, restarts {s['restarts']}, nodes {s['nodes'] or '-'}"
                     + (f", user {s['user']}" if s["user"] else ""))
    else:
        lines.append(f"job {st['job']}: slurm: {st['slurm_error']}")
    c = st["commit"]
    if st["remote_error"]:
        lines.append(f"checkpoint: cannot read {st['remote']}: {st['remote_error']}")
    elif not st["remote"]:
        lines.append("checkpoint: no [checkpoint] remote configured (pass --remote gs://BUCKET/PREFIX)")
    elif c is None:
        lines.append(f"checkpoint: nothing committed yet at {st['remote']}")
    else:
        age = f", {human_short(c['age_s'])} ago" if c.get("age_s") is not None else ""
        streak = f", {c['no_progress']} attempt(s) in a row without progress" if c.get("no_progress") else ""
        lines.append(f"checkpoint: {st['remote']}: last commit by attempt {c['attempt']} at {c['created']}{age}, "
                     f"{c['files']} file(s), {human_bytes(c['bytes'])}"
                     + (f" from {c['nodes']} nodes" if c.get("nodes", 1) > 1 else "") + streak)
    r = st["record"]
    if r:
        lines.append(_record_line(r, st["time"]))
    return "\n".join(lines)


def _record_line(r: dict[str, Any], now: float) -> str:
    """The running attempt's view, from its status record (the user's file: shown as text)."""
    def num(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    parts = [f"attempt {r.get('attempt')} on {r.get('node') or 'this node'}, {r.get('state')}"]
    updated = num(r.get("updated"))
    if updated is not None:
        parts[0] += f" (updated {human_short(max(0.0, now - updated))} ago)"
    restored = r.get("restored")
    if isinstance(restored, dict):
        parts.append(f"restored the commit of attempt {restored.get('attempt')}")
    sync = r.get("last_sync")
    if isinstance(sync, dict) and num(sync.get("seconds")) is not None:
        parts.append(f"last sync took {num(sync['seconds']):.1f} s")
    if num(r.get("lag_s")) is not None:
        parts.append(f"lag {num(r['lag_s']):.0f} s")
    held = r.get("held_back")
    if isinstance(held, list) and held:
        parts.append("held back: " + ", ".join(str(u) or "(top-level files)" for u in held[:10]))
    if r.get("error"):
        parts.append(f"last sync failed: {str(r['error'])[:200]}")
    return "this node: " + "; ".join(parts)
