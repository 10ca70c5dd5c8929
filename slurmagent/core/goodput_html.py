"""`slurmagent report --html FILE`: the report as one self-contained page (inline CSS and SVG, no
script, nothing fetched at view time), because people would rather look at it than read it.

Stable hooks for tests and scrapers: `id="ettr"` (the overall ETTR, `data-ettr`), `id="loss-chart"`
with one `class="cause-bar"` per cause (`data-cause`, `data-seconds`, `data-gpu-hours`), and per job
`class="job"` (`data-job`) holding `class="job-ettr"`, a `class="timeline"` SVG whose segments are
`class="seg seg-<part>"` and one `class="interruption"` (`data-cause`) per interruption, and
`class="root-event"` per root-side event; `id="nodes"` with `class="node"` (`data-faults`, `data-lemon`).
Pure: a report dict (core/goodput.build_report) in, a string out.
"""

from __future__ import annotations

from html import escape
from typing import Any

from .goodput import CAUSES, format_event, hms, pct, utc

COLOURS = {"progress": "#2e7d32", "restore": "#1565c0", "startup": "#8e24aa", "recompute": "#c62828",
           "hang_detection": "#ad1457", "flush": "#ef6c00", "pending": "#9e9e9e", "unrecorded": "#5d4037"}
ORDER = ("restore", "startup", "progress", "recompute", "hang_detection", "flush", "unrecorded", "pending")  # within an attempt
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#212121;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:24px 0 6px} .muted{color:#616161;font-size:13px}
.big{display:flex;gap:32px;align-items:baseline;margin:12px 0}
#ettr{font-size:44px;font-weight:700;color:#2e7d32} .label{font-size:13px;color:#616161}
table{border-collapse:collapse;font-size:13px;margin:6px 0} td,th{border-bottom:1px solid #e0e0e0;padding:3px 8px;
text-align:left} th{background:#f5f5f5} .legend span{display:inline-block;margin-right:14px;font-size:12px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}
section.job{border-top:2px solid #eeeeee;margin-top:18px} .warn{color:#b71c1c} .root-events{font-size:13px;margin:4px 0}
"""


def _attr(value: Any) -> str:
    return escape(str(value), quote=True)


def _bar_value(lost: dict[str, Any], cause: str, gpu: bool) -> float:
    return lost[cause]["gpu_hours"] if gpu else lost[cause]["seconds"] / 3600.0


def loss_chart(lost: dict[str, Any]) -> str:
    """Horizontal bars, one per cause: GPU-hours, or hours when no attempt recorded a GPU."""
    gpu = any(lost[c]["gpu_hours"] > 0 for c in CAUSES)
    unit = "GPU-hours" if gpu else "hours (no GPUs recorded)"
    top = max([_bar_value(lost, c, gpu) for c in CAUSES] + [0.0])
    row, label_w, bar_w = 30, 110, 560
    out = [f'<svg id="loss-chart" xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 190}" '
           f'height="{row * len(CAUSES) + 30}" role="img" aria-label="time lost by cause, {unit}">']
    for i, cause in enumerate(CAUSES):
        v = _bar_value(lost, cause, gpu)
        w = 0.0 if top <= 0 else max(2.0 if v > 0 else 0.0, bar_w * v / top)
        y = 10 + i * row
        out.append(f'<g class="cause-bar" data-cause="{cause}" data-seconds="{lost[cause]["seconds"]}" '
                   f'data-gpu-hours="{lost[cause]["gpu_hours"]}">'
                   f'<text x="0" y="{y + 15}" font-size="13">{cause}</text>'
                   f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="20" fill="{COLOURS[cause]}"/>'
                   f'<text x="{label_w + w + 6:.1f}" y="{y + 15}" font-size="12">{v:.3f} '
                   f'({hms(lost[cause]["seconds"])})</text></g>')
    out.append(f'<text x="{label_w}" y="{row * len(CAUSES) + 25}" font-size="11" fill="#616161">{unit}</text></svg>')
    return "".join(out)


def timeline(job: dict[str, Any], width: int = 1000) -> str:
    """Attempts left to right on one time axis: parts as coloured segments, interruptions as marks."""
    start, span = job["started"], max(job["ended"] - job["started"], 1e-9)
    scale = (width - 20) / span
    out = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="78" role="img" '
           f'aria-label="timeline of job {_attr(job["job"])}">']
    for a in job["attempts"]:
        t = a["started"]
        x0 = 10 + (t - start) * scale
        for part in ORDER:
            sec = a["seconds"][part]
            if sec <= 0:
                continue
            x, w = 10 + (t - start) * scale, max(sec * scale, 0.5)
            out.append(f'<rect class="seg seg-{part}" data-attempt="{a["attempt"]}" x="{x:.1f}" y="22" '
                       f'width="{w:.1f}" height="26" fill="{COLOURS[part]}"><title>attempt {a["attempt"]}: '
                       f'{part} {hms(sec)}</title></rect>')
            t += sec
        out.append(f'<text x="{x0 + 2:.1f}" y="16" font-size="11">#{a["attempt"]}</text>')
        if a["interruption"]:
            x = 10 + (a["until"] - start) * scale
            out.append(f'<g class="interruption" data-cause="{_attr(a["end"])}" data-attempt="{a["attempt"]}">'
                       f'<line x1="{x:.1f}" y1="18" x2="{x:.1f}" y2="52" stroke="#b71c1c" stroke-width="2"/>'
                       f'<text x="{x + 3:.1f}" y="66" font-size="11" fill="#b71c1c">{escape(a["end"])}</text></g>')
    out.append("</svg>")
    return "".join(out)


def _legend() -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{COLOURS[p]}"></i>{p}</span>' for p in ("progress", *CAUSES)) + "</div>"


def _job(job: dict[str, Any]) -> str:
    rows = "".join(
        f'<tr class="attempt" data-attempt="{a["attempt"]}" data-end="{_attr(a["end"])}"><td>{a["attempt"]}</td>'
        f'<td>{utc(a["started"])}</td><td>{utc(a["ended"])}</td><td>{escape(a["end"])}</td>'
        f'<td>{escape(a["why"])}</td><td>{"yes" if a["requeued"] else "no"}</td><td>{escape(str(a["nodes"]))}</td>'
        f'<td>{a["gpus"]}</td><td>{hms(a["seconds"]["progress"])}</td></tr>' for a in job["attempts"])
    return (f'<section class="job" data-job="{_attr(job["job"])}"><h2>job {escape(job["job"])} '
            f'<span class="muted">{escape(job["prefix"])}</span></h2>'
            f'<div>ETTR <b class="job-ettr" data-ettr="{job["ettr"]}">{pct(job["ettr"])}</b> &middot; making progress '
            f'{hms(job["progress_s"])} of {hms(job["wall_s"])} wall &middot; {len(job["attempts"])} attempts, '
            f'{len(job["interruptions"])} interruptions &middot; {job["gpus"]} GPUs</div>'
            f'{timeline(job)}<table><tr><th>attempt</th><th>started</th><th>ended</th><th>end</th><th>why</th>'
            f'<th>requeued</th><th>nodes</th><th>GPUs</th><th>progress</th></tr>{rows}</table>{_events(job)}</section>')


def _events(job: dict[str, Any]) -> str:
    if not job.get("root_events"):
        return ""
    items = "".join(f'<li class="root-event" data-event="{_attr(e.get("event", ""))}">{escape(format_event(e))}</li>'
                    for e in job["root_events"])
    return f'<div class="muted">root-side events for this job</div><ul class="root-events">{items}</ul>'


def _nodes(report: dict[str, Any]) -> str:
    if report.get("nodes") is None:
        return ""
    lem = report.get("lemon", {})
    rows = "".join(f'<tr class="node" data-node="{_attr(n["node"])}" data-faults="{n["faults"]}" '
                   f'data-lemon="{"yes" if n["lemon"] else "no"}"><td>{escape(n["node"])}</td><td>{n["faults"]}</td>'
                   f'<td>{utc(n["last_fault"])}</td><td>{"LEMON" if n["lemon"] else "no"}</td></tr>'
                   for n in report["nodes"])
    return (f'<h2>nodes: repairs within {lem.get("window_s", 0) / 86400:g} days (a lemon from {lem.get("faults")})</h2>'
            f'<table id="nodes"><tr><th>node</th><th>faults</th><th>last fault</th><th>lemon</th></tr>{rows}</table>')


def render_html(report: dict[str, Any]) -> str:
    tot = report["totals"]
    warnings = "".join(f'<p class="warn">{escape(e)}</p>' for e in report["errors"])
    jobs = "".join(_job(j) for j in report["jobs"]) or '<p id="no-jobs">no ledger records found</p>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>slurmagent goodput report</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<style>{CSS}</style></head><body>
<h1>slurmagent goodput report</h1>
<div class="muted">generated {utc(report["generated"])} &middot; ETTR = time making progress (first progress to the
last commit of each attempt) / wall time (first start to last end)</div>
<div class="big"><div><div class="label">ETTR</div><div id="ettr" data-ettr="{tot["ettr"]}">{pct(tot["ettr"])}</div></div>
<div><div class="label">jobs</div><b id="jobs">{tot["jobs"]}</b></div>
<div><div class="label">attempts</div><b id="attempts">{tot["attempts"]}</b></div>
<div><div class="label">interruptions</div><b id="interruptions">{tot["interruptions"]}</b></div></div>
<h2>time lost by cause</h2>{loss_chart(tot["lost"])}
{_legend()}{warnings}{_nodes(report)}{jobs}
</body></html>
"""
