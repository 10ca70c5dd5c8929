"""The expiry watch's decision for one check (expiry_policy.decide_expiry), without any I/O:
what it knows now (state, API answer, notices, clock) in, the steps to take out."""

from __future__ import annotations

import pytest

from slurmagent.policy import expiry as expiry_policy
from slurmagent.gcp.events import Events
from slurmagent.core.timefmt import fmt_time, from_epoch

T0 = 1_800_000_000.0
BOOT = "boot-a"


def api(termination: float | None, model: str = "FLEX_START", checked: float = T0) -> dict:
    return {"checked_at_epoch": checked, "scheduling": {
        "termination_time": fmt_time(from_epoch(termination)) if termination else None, "provisioning_model": model}}


def decide(termination: float | None = None, *, old: dict | None = None, events: Events | None = None, now: float = T0,
           override: float | None = None, lookup_failed: bool = False, max_time: float | None = None,
           drain_lead_s: float = 1800.0, flush_lead_s: float = 120.0) -> expiry_policy.ExpiryDecision:
    return expiry_policy.decide_expiry(
        now=now, node="n1", boot_id=BOOT, old=old or {}, events=events, lookup_failed=lookup_failed,
        override=from_epoch(override) if override else None, api=api(termination) if override is None else None,
        drain_lead_s=drain_lead_s, flush_lead_s=flush_lead_s,
        max_time_s=(lambda: max_time) if max_time is not None else None)


def our_drain(reason: str = "slurmagent: expiry: flex expiry at 2026-01-15T08:10:00Z", **more) -> dict:
    return {"boot_id": BOOT, "drained": True, "drain": "drained", "drain_reason": reason, **more}


def test_far_away_end_waits_for_the_first_threshold():
    d = decide(T0 + 3 * 3600)
    assert (d.drain_reason, d.flush_cause, d.release) == (None, None, None)
    assert d.remaining_s == 3 * 3600 and d.next_check_s == pytest.approx(3 * 3600 - 1800)
    assert d.state["termination_time"] == fmt_time(from_epoch(T0 + 3 * 3600)) and d.state["source"] == "compute-api"


def test_inside_the_drain_lead_drains_with_the_flex_reason_then_flushes_at_its_lead():
    d = decide(T0 + 600)
    assert d.drain_reason == f"slurmagent: expiry: flex expiry at {fmt_time(from_epoch(T0 + 600))}"
    assert d.flush_cause is None and d.next_check_s == pytest.approx(600 - 120)
    d = decide(T0 + 100)
    assert d.drain_reason and d.flush_cause == "VM expiry in 100 s" and d.next_check_s is None
    assert decide(T0 + 600, override=None).state["scheduling"]["provisioning_model"] == "FLEX_START"


def test_a_standard_vm_with_max_run_duration_says_vm_expiry():
    d = expiry_policy.decide_expiry(now=T0, node="n1", boot_id=BOOT, old={}, override=None, api=api(T0 + 60, "STANDARD"),
                             events=None, lookup_failed=False, drain_lead_s=1800, flush_lead_s=120)
    assert d.drain_reason.startswith("slurmagent: expiry: VM expiry at")


def test_config_override_wins_and_max_time_widens_the_drain_window():
    d = decide(override=T0 + 20 * 3600, max_time=86400.0)
    assert d.source == "config" and d.drain_reason is not None
    assert decide(override=T0 + 20 * 3600, max_time=0.0).drain_reason is None


def test_notices_drain_and_flush_at_once_and_the_sooner_end_wins():
    d = decide(T0 + 5 * 86400, events=Events(preempted="TRUE"))
    assert d.source == "preempted" and d.drain_reason.startswith("slurmagent: preempt:")
    assert d.flush_cause == "TRUE notice" and d.notes == ["preemption notice"]
    assert d.state["notice"]["termination_time"] == fmt_time(from_epoch(T0 + 30))
    d = decide(None, events=Events(maintenance="TERMINATE_ON_HOST_MAINTENANCE"))
    assert d.source == "maintenance-event" and d.drain_reason.startswith("slurmagent: maintenance:")
    assert d.flush_cause == "TERMINATE_ON_HOST_MAINTENANCE notice"
    d = decide(T0 + 10, events=Events(maintenance="TERMINATE_ON_HOST_MAINTENANCE"))
    assert d.source == "compute-api" and d.drain_reason.startswith("slurmagent: expiry:")  # the API end is sooner


def test_live_migration_is_noted_once():
    d = decide(None, events=Events(maintenance="MIGRATE_ON_HOST_MAINTENANCE"))
    assert d.notes == ["MIGRATE_ON_HOST_MAINTENANCE: live migration, nothing to do"] and d.drain_reason is None
    again = decide(None, old={"boot_id": BOOT, "last_maintenance_event": "MIGRATE_ON_HOST_MAINTENANCE"},
                   events=Events(maintenance="MIGRATE_ON_HOST_MAINTENANCE"))
    assert again.notes == []


def test_a_notice_that_passed_releases_our_drain_only_after_the_grace():
    notice = {"kind": "maintenance", "seen_at": fmt_time(from_epoch(T0)), "value": "TERMINATE_ON_HOST_MAINTENANCE",
              "termination_time": fmt_time(from_epoch(T0 + 60))}
    old = our_drain("slurmagent: maintenance: x", notice=notice)
    held = decide(None, old=old, events=Events(), now=T0 + 120)
    assert held.release is None and held.state["notice"] == notice and held.drain_reason  # still in force
    passed = decide(None, old=old, events=Events(), now=T0 + 60 + expiry_policy.NOTICE_GRACE_S + 1)
    assert passed.release.startswith("the maintenance notice of") and "notice" not in passed.state
    assert decide(None, old=old, events=Events(error="down"), now=T0 + 3600).release is None  # cannot tell: hold


def test_the_end_moving_away_undoes_our_drain_but_a_failed_lookup_never_does():
    old = our_drain()
    assert decide(T0 + 86400, old=old).release == "the termination time moved"
    assert decide(T0 + 1800 + 30, old=old).release is None  # inside the margin: keep it
    assert decide(None, old=old).release == "the termination time moved"  # no end any more
    assert decide(None, old=old, lookup_failed=True).release is None
    assert decide(T0 + 86400, old={"boot_id": BOOT, "drained": True, "drain": "kept-admin-drain",
                                   "drain_reason": "x"}).release is None  # not our drain
    assert decide(T0 + 86400, old=our_drain()).state["drained"]  # carried until the release succeeds


def test_state_of_an_earlier_boot_is_discarded():
    d = decide(T0 + 3 * 3600, old={**our_drain(), "boot_id": "old", "flushed": True})
    assert d.notes == ["discarded the expiry state of an earlier boot (old)"]
    assert "drained" not in d.state and "flushed" not in d.state and d.release is None
    assert d.state["boot_id"] == BOOT


def test_cached_api_answer_freshness():
    cached = api(T0 + 86400, checked=T0)
    assert expiry_policy.api_answer_fresh(cached, T0 + 60, 3600.0, "n1")
    assert not expiry_policy.api_answer_fresh(cached, T0 + 2 * 3600, 3600.0, "n1")
    assert not expiry_policy.api_answer_fresh(None, T0, 3600.0, "n1")
    outlived = api(T0 + 100, checked=T0)  # the VM lives on past the time it was given
    assert expiry_policy.api_answer_fresh(outlived, T0 + 200, 3600.0, "n1")
    assert not expiry_policy.api_answer_fresh(outlived, T0 + 100 + expiry_policy.STALE_RECHECK_S + 1, 3600.0, "n1")
    assert 0.9 <= expiry_policy.refresh_jitter("n1") <= 1.1 and expiry_policy.refresh_jitter("n1") == expiry_policy.refresh_jitter("n1")



# --- host maintenance with notice ---------------------------------------------------------------

TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"


def gpu_api(window: float | None = None, on_host_maintenance: str = "TERMINATE", gpu_vm: bool = True,
            checked: float = T0) -> dict:
    return {"checked_at_epoch": checked, "scheduling": {
        "termination_time": None, "provisioning_model": "STANDARD", "on_host_maintenance": on_host_maintenance,
        "gpu_vm": gpu_vm, "maintenance_window_start": fmt_time(from_epoch(window)) if window else None}}


def decide_m(api_answer: dict, *, events: Events | None = None, old: dict | None = None, now: float = T0):
    return expiry_policy.decide_expiry(now=now, node="n1", boot_id=BOOT, old=old or {}, override=None, api=api_answer,
                                events=events, lookup_failed=False, drain_lead_s=1800.0, flush_lead_s=120.0)


def step(d: expiry_policy.ExpiryDecision, **flags) -> dict:
    """The state the watch writes after carrying out d (drained when asked, flushed when asked)."""
    st = dict(d.state)
    if d.drain_reason:
        st.update(drained=True, drain="drained", drain_reason=d.drain_reason)
    if d.flush_cause:
        st.update(flushed=True)
    if d.release:
        for k in expiry_policy.EXPIRY_DRAIN_KEYS:
            st.pop(k, None)
    return {**st, **flags}


def test_a_gpu_vm_notice_without_a_window_means_an_hour_drain_and_flush_at_their_leads():
    notice = Events(maintenance=TERMINATE)
    d = decide_m(gpu_api(), events=notice)
    assert d.termination.timestamp() == T0 + 3600 and d.source == "maintenance-event"
    assert (d.drain_reason, d.flush_cause) == (None, None) and d.next_check_s == pytest.approx(1800)
    d = decide_m(gpu_api(), events=notice, old=step(d), now=T0 + 1800)
    assert d.drain_reason == f"slurmagent: maintenance: {TERMINATE} (VM stops at about {fmt_time(from_epoch(T0 + 3600))})"
    assert d.flush_cause is None and d.next_check_s == pytest.approx(1800 - 120)
    d = decide_m(gpu_api(), events=notice, old=step(d), now=T0 + 3600 - 120)
    assert d.flush_cause == f"{TERMINATE} notice" and d.termination.timestamp() == T0 + 3600
    assert decide_m(gpu_api(gpu_vm=False), events=notice).flush_cause == f"{TERMINATE} notice"  # 60 s: at once


def test_the_api_window_is_t_with_or_without_the_notice_and_migrate_does_nothing():
    d = decide_m(gpu_api(window=T0 + 2400), events=Events(maintenance=TERMINATE))
    assert d.termination.timestamp() == T0 + 2400 and d.drain_reason is None and d.next_check_s == pytest.approx(600)
    scheduled = decide_m(gpu_api(window=T0 + 1000), events=Events())  # known days ahead; no notice yet
    assert scheduled.source == "upcoming-maintenance" and scheduled.drain_reason.startswith("slurmagent: maintenance:")
    assert scheduled.flush_cause is None
    assert decide_m(gpu_api(window=T0 + 100), events=Events()).flush_cause == "host maintenance in 100 s"
    migrate = decide_m(gpu_api(window=T0 + 100, on_host_maintenance="MIGRATE"),
                       events=Events(maintenance="MIGRATE_ON_HOST_MAINTENANCE"))
    assert (migrate.termination, migrate.drain_reason, migrate.flush_cause) == (None, None, None)
    assert migrate.notes == ["MIGRATE_ON_HOST_MAINTENANCE: live migration, nothing to do"]


def test_a_rescheduled_or_cancelled_window_resumes_our_drain():
    notice = Events(maintenance=TERMINATE)
    d = decide_m(gpu_api(window=T0 + 1200), events=notice)
    assert d.drain_reason
    drained = step(d)
    moved = decide_m(gpu_api(window=T0 + 7 * 86400, checked=T0 + 300), events=notice, old=drained, now=T0 + 300)
    assert moved.notes == [f"maintenance window moved to {fmt_time(from_epoch(T0 + 7 * 86400))}"]
    assert moved.release == "the termination time moved" and moved.drain_reason is None
    cancelled = decide_m(gpu_api(checked=T0 + 300), events=Events(), old=drained, now=T0 + 300)
    assert cancelled.notes[0].startswith("the maintenance notice of") and "withdrawn" in cancelled.notes[0]
    assert cancelled.release == "the termination time moved" and "notice" not in cancelled.state
    near = decide_m(gpu_api(checked=T0 + 1150), events=Events(), old=drained, now=T0 + 1150)  # at T: it is happening
    assert near.release is None and near.drain_reason and near.state["notice"]


def test_preemption_is_thirty_seconds_whatever_the_vm():
    d = decide_m(gpu_api(window=T0 + 3000), events=Events(preempted="TRUE"))
    assert d.termination.timestamp() == T0 + 30 and d.source == "preempted" and d.drain_reason and d.flush_cause


def test_the_api_is_read_again_when_the_event_changes_or_a_window_is_near():
    cached = gpu_api(checked=T0)
    assert expiry_policy.api_answer_fresh(cached, T0 + 60, 3600.0, "n1")
    assert not expiry_policy.api_answer_fresh(cached, T0 + 60, 3600.0, "n1", event_changed=True)
    near = gpu_api(window=T0 + 3000, checked=T0)
    assert expiry_policy.api_answer_fresh(near, T0 + 200, 3600.0, "n1", window_soon_s=3600.0)
    assert not expiry_policy.api_answer_fresh(near, T0 + expiry_policy.STALE_RECHECK_S + 1, 3600.0, "n1", window_soon_s=3600.0)
    assert expiry_policy.api_answer_fresh(near, T0 + expiry_policy.STALE_RECHECK_S + 1, 3600.0, "n1", window_soon_s=1000.0)


def test_read_failures_lasting_or_passing():
    """A 403/404/400 turns expiry protection off at once; a malformed answer only several times in
    a row; a 5xx or a timeout passes by itself and neither starts nor ends a row; an answer ends it."""
    from slurmagent.policy.expiry import MALFORMED_LASTING_AFTER, read_failure_reason, read_failure_streak

    assert [read_failure_reason(s, False, "x") for s in (401, 403, 404, 400, 429, 500, None)] == [
        "permission", "permission", "not-found", "refused", "unavailable", "unavailable", "unavailable"]
    assert read_failure_reason(None, True, "malformed response") == "malformed"
    assert read_failure_reason(None, False, "instances.get: terminationTime 'x' is not a usable time") == "malformed"
    assert read_failure_reason(None, False, "instances.get: no instance 'n1' in p/z") == "not-found"
    assert read_failure_streak(None, "permission", 0.0)[1] == "permission"
    rec, off = None, None
    for _ in range(MALFORMED_LASTING_AFTER - 1):
        rec, off = read_failure_streak(rec, "malformed", 0.0)
        assert off is None
        rec, off = read_failure_streak(rec, "unavailable", 0.0)  # in between: the row goes on
        assert off is None and rec["count"] >= 1
    rec, off = read_failure_streak(rec, "malformed", 0.0)
    assert off == "malformed" and rec["count"] == MALFORMED_LASTING_AFTER
    assert read_failure_streak(rec, None, 0.0) == (None, None)
