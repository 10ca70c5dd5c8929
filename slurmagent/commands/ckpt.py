"""`slurmagent ckpt ls|gc --remote gs://B/P`: a checkpoint prefix's commits, and its clean-up by hand.

`ls` reads ``commits/`` (and ``manifest.json``); `gc` runs the same clean-up a job runs after
each commit (:mod:`slurmagent.checkpoint.gcs.retention`), as a tool: no attempt of its own, so
it fences nobody, but it re-reads and protects the newest manifest before each batch of deletes.
"""

from __future__ import annotations

from typing import TextIO

from ..checkpoint.gcs.store import GcsCheckpointStore
from ..checkpoint.gcs.retention import GcResult, list_commits, read_commit
from ..checkpoint.gcs.transfer import Deadline, human_size

__all__ = ["format_gc", "list_remote_commits", "run_gc", "run_ls"]


def _store(remote: str, cfg):
    ck = cfg.checkpoint
    return GcsCheckpointStore(remote, max_workers=ck.transfers, keep_commits=ck.keep_commits,
                              gc_grace_s=ck.gc_grace_s)


def list_remote_commits(store, keep: int, deadline_s: float = 120.0) -> list[dict]:
    """One row per commit, oldest first: id, attempt, owner, created, files, bytes, status
    (``latest``, ``kept``, ``old``: beyond ``keep``, removed by the next clean-up after its grace).
    A ``manifest.json`` with no record of its own (written before retention) is a row ``-``."""

    def rows(dl: Deadline) -> list[dict]:
        newest, generation = store.manifests.read(dl)
        commits = list_commits(store.objects, dl)
        out = []
        ids = [c.id for c in commits]
        for i, c in enumerate(commits):
            m = read_commit(store.objects, c, dl)
            if m is None:
                continue
            out.append(_row(c.id, m, "kept" if i >= len(commits) - keep else "old"))
        if newest is not None:
            mine = f"{generation:020d}"
            if mine in ids:
                for r in out:
                    if r["commit"] == mine:
                        r["status"] = "latest"
            else:
                out.append(_row("-", newest, "latest"))
        return out

    return store._guard(rows, Deadline(deadline_s), "listing the commits of")


def _row(commit_id: str, m, status: str) -> dict:
    return {"commit": commit_id, "attempt": m.attempt, "owner": m.owner, "created": m.created,
            "files": len(m.files), "bytes": m.total_bytes, "status": status}


def format_commits(rows: list[dict], url: str) -> str:
    if not rows:
        return f"no commits under {url}"
    lines = [f"{'COMMIT':<20}  {'ATTEMPT':>7}  {'CREATED':<20}  {'FILES':>6}  {'BYTES':>10}  STATUS"]
    for r in rows:
        lines.append(f"{r['commit']:<20}  {r['attempt']:>7}  {r['created']:<20}  {r['files']:>6}  "
                     f"{human_size(r['bytes']):>10}  {r['status']}")
    return "\n".join(lines)


def run_ls(cfg, remote: str, as_json: bool, out: TextIO) -> int:
    import json

    store = _store(remote, cfg)
    rows = list_remote_commits(store, cfg.checkpoint.keep_commits)
    out.write((json.dumps(rows, indent=1) if as_json else format_commits(rows, store.url)) + "\n")
    return 0


def format_gc(result: GcResult, url: str, bucket: str, grace_s: float) -> str:
    """One line per object (and commit record) deleted, or that would be, then the totals."""
    verb = "would delete" if result.dry_run else "deleted"
    if result.fenced:
        return f"{url}: nothing deleted: {result.fenced}"
    lines = [f"{verb} gs://{bucket}/{o.name} ({human_size(o.size)})" for o in result.deleted]
    lines += [f"{verb} commit {c}" for c in result.dropped_commits]
    lines.append(
        f"{url}: {verb} {len(result.deleted)} object(s) and {len(result.dropped_commits)} commit record(s), "
        f"{'would free' if result.dry_run else 'freed'} {human_size(result.bytes_freed)}; "
        f"{len(result.kept_commits)} commit(s) kept; {result.waiting} unreferenced object(s) within the "
        f"grace period of {grace_s:g}s"
    )
    if result.marked or result.revived:
        lines.append(f"{url}: {'would mark' if result.dry_run else 'marked'} {len(result.marked)} object(s) for the "
                     f"bucket's daysSinceCustomTime lifecycle rule; {'would revive' if result.dry_run else 'revived'} "
                     f"{len(result.revived)} marked object(s) a commit references again")
    return "\n".join(lines)


def run_gc(cfg, remote: str, dry_run: bool, keep: int | None, grace_s: float | None, out: TextIO) -> int:
    store = _store(remote, cfg)
    grace = cfg.checkpoint.gc_grace_s if grace_s is None else grace_s
    result = store.collect_garbage(keep=keep or cfg.checkpoint.keep_commits, grace_s=grace, dry_run=dry_run)
    out.write(format_gc(result, store.url, store.bucket_name, grace) + "\n")
    return 0
