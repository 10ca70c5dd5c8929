"""The XID catalog: drain set vs warning set as DESIGN.md and NVIDIA's catalog say."""

from __future__ import annotations

import dataclasses

import pytest

from slurmagent.core import xid
from slurmagent.core.xid import CATALOG, XidAction, XidInfo, classify, lookup, table_markdown

REQUIRED = [8, 13, 31, 32, 38, 43, 44, 45, 48, 56, 57, 58, 61, 62, 63, 64, 68, 69, 74, 79,
            92, 94, 95, 109, 110, 119, 120, 121, 122, 123, 124, 140, 143, *range(144, 151), 154]
DRAIN = [48, 62, 64, 74, 79, 95, 109, 119, 120]
WARN = [8, 13, 31, 43, 45, 94, 63, 92]


def test_required_codes_are_catalogued() -> None:
    assert [c for c in REQUIRED if c not in CATALOG] == []


@pytest.mark.parametrize("code", DRAIN)
def test_drain_set(code: int) -> None:
    info = lookup(code)
    assert info.drains
    assert info.action in (XidAction.RESET_GPU, XidAction.REBOOT_NODE, XidAction.HW_FAULT)


@pytest.mark.parametrize("code", WARN)
def test_warning_set(code: int) -> None:
    info = lookup(code)
    assert not info.drains
    assert info.action in (XidAction.RESTART_APP, XidAction.IGNORE)


@pytest.mark.parametrize(
    ("code", "action"),
    [
        (79, XidAction.REBOOT_NODE),  # RESTART_BM
        (48, XidAction.RESET_GPU),  # WORKFLOW_XID_48, solo: reset
        (13, XidAction.RESTART_APP),
        (31, XidAction.RESTART_APP),
        (94, XidAction.RESTART_APP),
        (43, XidAction.IGNORE),
        (63, XidAction.IGNORE),
        (92, XidAction.IGNORE),
        (121, XidAction.IGNORE),
        (61, XidAction.HW_FAULT),  # CONTACT_SUPPORT
        (122, XidAction.HW_FAULT),
        (140, XidAction.RESET_GPU),
        (143, XidAction.RESET_GPU),
    ],
)
def test_catalog_buckets(code: int, action: XidAction) -> None:
    assert lookup(code).action is action


def test_drains_is_consistent_with_action() -> None:
    for code, info in CATALOG.items():
        assert info.code == code
        assert info.drains == (info.action in xid.DRAIN_ACTIONS), code
        assert info.action is not XidAction.UNKNOWN
        assert info.meaning and len(info.meaning) <= 45 and "," not in info.meaning
        assert info.bucket


def test_meaning_reads_well_in_a_drain_reason() -> None:
    assert lookup(79).meaning == "fallen off the bus"
    assert f"xid 79 on gpu 3 ({lookup(79).meaning})" == "xid 79 on gpu 3 (fallen off the bus)"


def test_unknown_code() -> None:
    assert lookup(9999) == XidInfo(9999, "unknown xid", XidAction.UNKNOWN, drains=False)
    assert classify(9999, "anything") == lookup(9999)


def test_info_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        lookup(79).drains = False  # type: ignore[misc]


def test_action_is_a_string_enum() -> None:
    assert XidAction.RESET_GPU == "reset_gpu"
    assert isinstance(XidAction.IGNORE, str)


@pytest.mark.parametrize(
    ("detail", "action"),
    [
        ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
         XidAction.RESET_GPU),
        ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
         XidAction.REBOOT_NODE),
        ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)",
         XidAction.RESET_GPU),
        ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", XidAction.RESET_GPU),
        ("GPU recovery action changed from 0x1 (PF FLR) to 0x0 (None)", XidAction.IGNORE),
    ],
)
def test_xid154_follows_the_reported_action(detail: str, action: XidAction) -> None:
    info = classify(154, detail)
    assert info.action is action
    assert info.drains == (action is not XidAction.IGNORE)
    assert info.bucket == "XID_154"


def test_xid154_without_text_is_conservative() -> None:
    assert classify(154, "").drains
    assert classify(154, "to 0x99 (Something New)").drains


@pytest.mark.parametrize(
    ("code", "detail", "drains"),
    [
        (149, "NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000 0x00000000)", True),
        (149, "NETIR_MFDE_EVENT Nonfatal XC0 i0 Link 00 (0x00000014 0x00000003)", False),
        (145, "RLW_REMAP Nonfatal XC1 i0 Link 03 (0x00000082 0x00000001)", False),
        (144, "SAW_MVB Fatal XC0 i0 Link -1 (0x00000021 0x00000002)", True),
        (150, "", True),  # no text: code-only answer, which drains
    ],
)
def test_nvlink5_severity(code: int, detail: str, drains: bool) -> None:
    assert classify(code, detail).drains is drains


def test_classify_passes_other_codes_through() -> None:
    assert classify(79, "GPU has fallen off the bus.") is lookup(79)
    assert classify(13, "Fatal-looking text") is lookup(13)


def test_table_markdown() -> None:
    table = table_markdown()
    lines = table.strip().splitlines()
    assert lines[0].startswith("| xid | meaning | action | drains")
    assert len(lines) == 2 + len(CATALOG)
    assert "| 79 | fallen off the bus | reboot_node | yes | `RESTART_BM` |" in lines
    assert "| 13 | graphics engine exception | restart_app | no | `RESTART_APP` |" in lines
    codes = [int(row.split("|")[1]) for row in lines[2:]]
    assert codes == sorted(CATALOG)
