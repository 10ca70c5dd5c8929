"""`slurmagent journal [--replay] [--json]`: this node's pending actions, as lines or as JSON.

Exit codes (errors.py): 0 nothing pending; 1 actions pending (after the replay, with
`--replay`), or a journal a root process refuses to read; 3 the replay stopped because
slurmctld could not be reached. A journal this user cannot read is an error (exit 2), never
"no pending actions".
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from ..actions.executor import JournalExecutor
from ..actions.handlers import SLURM_UNREACHABLE
from ..errors import EXIT_OK, EXIT_PROBLEMS, EXIT_UNREACHABLE, SlurmagentError
from ..slurm.commands import Slurm
from ..state.build import version
from ..state.config import Config
from ..state.journal import Entry, Journal


def entry_json(entry: Entry, state: str, now: float) -> dict[str, Any]:
    """One entry: `state` pending, done, failed (given up) or dropped (stale)."""
    return {"id": entry.id, "kind": entry.kind, "state": state, "created": entry.created,
            "age_s": round(now - entry.created, 1), "payload": entry.payload, "attempts": entry.attempts,
            "last_error": entry.last_error}


def replay_state(outcome: str) -> str:
    """What a replay's outcome line means for its entry (journal.py writes these prefixes)."""
    for prefix in ("pending", "failed", "dropped"):
        if outcome.startswith(prefix + ":"):
            return prefix
    return "done"


def run_journal(cfg: Config, node: str, *, replay: bool, as_json: bool, out: TextIO,
                slurm: Slurm | None = None) -> int:
    j = Journal.for_config(cfg, node)
    why = j.unreadable()
    if why:
        raise SlurmagentError(f"journal: {why}")
    untrusted = j.untrusted()
    replayed: list[tuple[Entry, str]] = []
    if replay and not untrusted:
        replayed = JournalExecutor(cfg, slurm or Slurm.from_config(cfg), node, journal=j).replay()
    pending = [] if untrusted else j.pending()
    stopped = next((o.split(": ", 1)[1] for _, o in replayed if o.startswith(f"pending: {SLURM_UNREACHABLE}")), None)
    code = EXIT_UNREACHABLE if stopped else (EXIT_PROBLEMS if pending or untrusted else EXIT_OK)
    if as_json:
        now = j.clock()
        doc = {"version": version(), "node": node, "dir": str(j.dir), "untrusted": untrusted, "slurm_error": stopped,
               "replayed": [{**entry_json(e, replay_state(o), now), "outcome": o} for e, o in replayed],
               "entries": [entry_json(e, "pending", now) for e in pending], "exit_code": code}
        print(json.dumps(doc, indent=1), file=out)
        return code
    for entry, outcome in replayed:
        print(f"{entry.kind} {json.dumps(entry.payload, sort_keys=True)}: {outcome}", file=out)
    for e in pending:
        print(f"pending {e.kind} {json.dumps(e.payload, sort_keys=True)} attempts={e.attempts} {e.last_error}".rstrip(),
              file=out)
    if untrusted:
        print(f"not read: {untrusted} (fix: chown -R root {j.dir}; chmod -R go-w {j.dir})", file=out)
    elif not pending:
        print(f"no pending actions in {j.dir}", file=out)
    return code
