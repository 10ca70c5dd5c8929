"""The drain-reason grammar: `slurmagent: <rule>: <detail>`, built, cleaned and read here only.

Only nodes whose reason starts with `slurmagent:` are ever resumed or repaired by
slurmagent; admin drains are never touched. One cleaning rule (`clean_reason`) for every
text slurmagent hands to `scontrol update` (reasons and the breaker's Comment mark): it reads
well in `sinfo -R`, cannot smuggle a second `Key=Value` into scontrol, and is at most
`MAX_REASON` characters.

Planned drains (`expiry`, `maintenance`, `preempt`: the VM is going away on schedule) are
told apart from faults here, for the circuit breaker, which counts faults only.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from .timefmt import fmt_time

PREFIX = "slurmagent:"
REPAIRING = "repairing"
MAX_REASON = 200
COMMENT_TAG = "slurmagent"  # our marks in a node's Comment start with this
TERMINATE_ON_HOST_MAINTENANCE = "TERMINATE_ON_HOST_MAINTENANCE"

# The VM is going away on schedule: drained ahead, never repaired, not counted by the breaker.
PLANNED_RULES = ("expiry", "maintenance", "preempt")
# Not hardware faults a new VM would fix: `repair` leaves these drained.
NOT_REPAIRED_RULES = ("expiry", "maintenance", "internal error", "termination", "preempt")
INTERNAL_ERROR_RULE = "internal error"

_UNSAFE = re.compile(r"[^A-Za-z0-9 _.,:;/()@+#%-]")


def clean_reason(text: str) -> str:
    """The one cleaning rule: safe characters only, single spaces, at most MAX_REASON long."""
    text = _UNSAFE.sub(" ", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text[:MAX_REASON]


def make_reason(rule: str, detail: str) -> str:
    return clean_reason(f"{PREFIX} {rule}: {detail}" if detail else f"{PREFIX} {rule}")


def reason_from_summary(summary: str) -> str:
    """A finding's summary (`rule: detail`) -> its drain reason."""
    rule, sep, detail = summary.partition(": ")
    return make_reason(rule, detail) if sep else make_reason(summary, "")


def reason_for(report: Any) -> str:
    """The drain reason of an unhealthy checks.Report: its worst finding."""
    worst = report.worst
    assert worst is not None
    return reason_from_summary(worst.summary)


ADOPTED_RULE = "adopted"


def adopted_reason(their_reason: str) -> str:
    """Another tool's drain handed to `repair` by `[repair] adopt_reasons`: ours from now on, its text kept."""
    return make_reason(ADOPTED_RULE, their_reason)


def internal_error_reason(what: str) -> str:
    """slurmagent itself failed (fail-closed hooks): said apart from any GPU fault."""
    return make_reason(INTERNAL_ERROR_RULE, what)


def is_ours(reason: str) -> bool:
    return reason.startswith(PREFIX)


def reason_body(reason: str) -> str:
    """`slurmagent: xid 79 on gpu 3 (...)` -> `xid 79 on gpu 3 (...)`."""
    return reason[len(PREFIX):].strip() if reason.startswith(PREFIX) else reason


def is_repairing(reason: str) -> bool:
    return is_ours(reason) and reason_body(reason).startswith(REPAIRING + ":")


def fault_text(reason: str) -> str:
    """The fault without the repair state: `repairing: xid 79 ...` -> `xid 79 ...`."""
    body = reason_body(reason)
    if body.startswith(REPAIRING + ":"):
        body = body[len(REPAIRING) + 1:].strip()
    return body


def repairing_reason(reason: str) -> str:
    return clean_reason(f"{PREFIX} {REPAIRING}: {fault_text(reason)}")


def fault_reason(reason: str) -> str:
    """Back from `repairing` to the plain fault reason (after a failed repair request)."""
    return clean_reason(f"{PREFIX} {fault_text(reason)}")


def rule_of(reason: str) -> str:
    text = fault_text(reason)
    m = re.match(r"xid \d+", text)
    if m:
        return m[0]
    return text.split(":", 1)[0].strip()


def _rule_in(reason: str, rules: tuple[str, ...]) -> bool:
    rule = rule_of(reason)
    return any(rule == r or rule.startswith(r + " ") or rule.startswith(r + "-") for r in rules)


def repairable(reason: str) -> bool:
    return not _rule_in(reason, NOT_REPAIRED_RULES)


def is_planned(reason: str) -> bool:
    """A drain ahead of a scheduled end of the VM (expiry, maintenance, preemption notice)."""
    return any(reason.startswith(f"{PREFIX} {rule}:") for rule in PLANNED_RULES)


is_expiry_reason = is_planned  # the expiry watch's own name for it


def expiry_reason(when: datetime, kind: str = "expiry", provisioning_model: str = "") -> str:
    """The planned drain reason, rule expiry | maintenance | preempt."""
    at = fmt_time(when)
    if kind == "maintenance":
        return make_reason("maintenance", f"{TERMINATE_ON_HOST_MAINTENANCE} (VM stops at about {at})")
    if kind == "preempt":
        return make_reason("preempt", f"VM preempted (stops at about {at})")
    label = "flex" if provisioning_model in ("", "FLEX_START") else "VM"
    return make_reason("expiry", f"{label} expiry at {at}")


def suppressed_comment(now: float, summary: str) -> str:
    """The breaker's mark in the node's Comment: it kept slurmagent from draining this node."""
    return clean_reason(f"{COMMENT_TAG} suppressed@{now:.3f} {summary}")
