"""`slurmagent report`: the goodput ledger of the jobs under a bucket prefix, as text, JSON or
one self-contained HTML page. Reads the records (`checkpoint/gcs/ledger.py`), folds them
(`core/goodput.py`), draws them (`core/goodput_html.py`); changes nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from ..core.goodput import attach_root_events, build_report, format_text, parse_duration
from ..core.goodput_html import render_html
from ..errors import SlurmagentError
from ..policy import lemon
from ..state import decisionlog, repair_state
from ..state.config import Config
from ..state.host import node_name

READ_DEADLINE_S = 120.0


class ReportError(SlurmagentError):
    """The report cannot be made: no prefix named, a bad option, the bucket not readable."""

    exit_code = 2


def run_report(cfg: Config, out: TextIO, *, remote: str | None = None, job: str | None = None,
               since: str | None = None, as_json: bool = False, html: str | None = None,
               reader: Callable[[str], tuple[list, list]] | None = None, now: float | None = None,
               state_dir: str | None = None, decision_logs: tuple[str, ...] = ()) -> int:
    remote = remote or cfg.checkpoint.remote
    if not remote:
        raise ReportError("report: no --remote gs://BUCKET/PREFIX and no [checkpoint] remote in the config")
    if not remote.startswith("gs://"):
        raise ReportError(f"report: --remote {remote!r} is not a gs://BUCKET/PREFIX")
    try:
        since_s = parse_duration(since) if since is not None else None
    except ValueError as exc:
        raise ReportError(f"report: --since {exc}") from None
    records, errors = (reader or read_ledger)(remote)
    now = time.time() if now is None else now
    report = build_report(records, now=now, job=job, since_s=since_s, errors=errors)
    report["remote"] = remote
    add_root_side(cfg, report, now, state_dir, decision_logs)
    if html is not None:
        try:
            Path(html).write_text(render_html(report), encoding="utf-8")
        except OSError as exc:
            raise ReportError(f"report: cannot write {html}: {exc.strerror or exc}") from None
    if as_json:
        out.write(json.dumps(report, indent=1, sort_keys=True) + "\n")
    else:
        out.write(format_text(report) + "\n")
        if html is not None:
            out.write(f"wrote {html}\n")
    return 0


class TerminalProgress:
    """`reading the ledger: 1200/3000 records` on one line of a terminal, redrawn at most every
    `every_s` and cleared at the end; nothing where the stream is not a terminal (a pipe, a file, cron)."""

    def __init__(self, stream: TextIO, every_s: float = 0.2, clock: Callable[[], float] = time.monotonic):
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self.on = bool(getattr(stream, "isatty", lambda: False)())
        self.drawn_at = -every_s
        self.width = 0

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if not self.on or done < total and now - self.drawn_at < self.every_s:
            return
        self.drawn_at = now
        line = f"reading the ledger: {done}/{total} records"
        self._write("\r" + line.ljust(self.width))
        self.width = len(line)

    def close(self) -> None:
        if self.on and self.width:
            self._write("\r" + " " * self.width + "\r")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away (EIO, EPIPE, closed): no more line, the report goes on
            self.on = False


def read_ledger(remote: str, err: TextIO | None = None) -> tuple[list, list]:
    """Every record under `remote` (its own ledger and each job prefix's), a progress line on a
    terminal's stderr meanwhile; unreachable: exit 2."""
    from ..checkpoint.gcs.ledger import LedgerBucket  # start-up speed: google only here

    bar = TerminalProgress(sys.stderr if err is None else err)
    try:
        return LedgerBucket(remote).read_all(deadline_s=READ_DEADLINE_S, progress=bar)
    except SlurmagentError as exc:
        raise ReportError(f"report: cannot read the ledger under {remote}: {exc}") from None
    finally:
        bar.close()


def add_root_side(cfg: Config, report: dict, now: float, state_dir: str | None, decision_logs: tuple[str, ...]) -> None:
    """What the root side knows, where this user may read it: per node the faults the repair
    loop repaired (`--state-dir`, the node that runs `repair`; else this node's state dir when it
    holds a repair history), and per job the decision-log lines naming it (`--decision-log`,
    else this node's). Unreadable: a warning, the rest of the report stands."""
    sdir = Path(state_dir) if state_dir else cfg.state_path(node_name())
    if state_dir or os.path.exists(repair_state.state_file(sdir)):  # False, not raised, in a dir it may not enter
        if not os.access(repair_state.state_file(sdir), os.R_OK):
            report["errors"].append(f"cannot read the repair history {repair_state.state_file(sdir)}")
        state = repair_state.load_state(sdir)
        keys = dict(faults=int(cfg.repair.lemon_faults), window_s=float(cfg.repair.lemon_window_s))
        report["lemon"] = keys
        report["nodes"] = lemon.node_faults(state.get("history", {}), now, hangs=state.get("hangs"),
                                            whys=state.get("hang_why"), **keys)
    logs = [Path(p) for p in decision_logs] or [p for p in [decisionlog.path_for(cfg, node_name())] if os.path.exists(p)]
    records: list = []
    for path in logs:
        if not os.access(path, os.R_OK):
            report["errors"].append(f"cannot read the decision log {path}")
        records += decisionlog.read_records(path)
    if logs:
        attach_root_events(report, records)
        report["decision_logs"] = [str(p) for p in logs]
