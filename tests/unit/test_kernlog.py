"""Kernel-log XIDs: parsing recorded lines, PCI mapping, sources and the cursor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import DATA as SUPPORT_DATA, REPO

from slurmagent.state import host
from slurmagent.gpu import kernlog
from slurmagent.core.kernel_xid import KernelXid, map_to_gpus, normalize_pci, parse_line, parse_lines, parse_text
from slurmagent.gpu.kernlog import (
    Cursor,
    DmesgSource,
    FileSource,
    JournalSource,
    KernlogError,
    KmsgSource,
    commit_cursor,
    load_cursor,
    read_new,
    read_since,
)
from slurmagent.core.snapshot import GpuState
from slurmagent.core.xid import lookup

DATA = SUPPORT_DATA / "kernlog"
BOOT = "7d710ba7-7aa8-4e1f-ae8e-1191e923ee32"

# What every recorded fixture holds, in order: (xid, pci, pid, process).
EXPECTED = [
    (13, "0000:18:00", "2271", "python"),
    (13, "0000:18:00", "2271", "python"),
    (31, "0000:b7:00", "1234", "python3"),
    (48, "0000:86:00", None, None),
    (63, "0000:86:00", None, None),
    (64, "0000:86:00", None, None),
    (74, "0000:8a:00", None, None),
    (79, "0000:3b:00", None, None),
    (92, "0000:5e:00", None, None),
    (94, "0000:0f:00", "2503421", "python3"),
    (95, "0000:37:00", "5171", None),
    (119, "0000:1b:00", "3849", "KMS thread"),
    (120, "0000:1b:00", "9111", "pt_main_thread"),
]
XID_CODES = [e[0] for e in EXPECTED]


def _summary(xids: list[KernelXid]) -> list[tuple[int, str, str | None, str | None]]:
    return [(x.xid, x.pci, x.pid, x.process) for x in xids]


# --- parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dmesg.log", "journal-short.log", "kmsg.txt"])
def test_recorded_fixtures(name: str) -> None:
    xids = parse_text((DATA / name).read_text(encoding="utf-8"))
    assert _summary(xids) == EXPECTED
    by_code = {x.xid: x for x in xids}
    assert by_code[79].detail == "GPU has fallen off the bus."
    assert by_code[48].detail.startswith("An uncorrectable double bit error (DBE)")
    assert by_code[95].detail == "Uncontained: FBHUB. RST: Yes, D-RST: No"
    assert by_code[31].detail.startswith("Ch 00000008, intr 00000000. MMU Fault")
    assert by_code[119].detail.startswith("Timeout after 6s of waiting for RPC response")
    assert all("NVRM: Xid (" in x.raw and not x.raw.endswith("\n") for x in xids)


def test_prefixes_are_kept_in_raw() -> None:
    line = "[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
    x = parse_line(line)
    assert x == KernelXid(79, "0000:3b:00", None, None, "GPU has fallen off the bus.",
                          line.rstrip("\n"))


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        "Nov 30 05:00:00 host kernel: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        "6,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        "2026-11-30T05:00:00.123456+00:00 host kernel: [ 99.1] NVRM: Xid (0000:3b:00): 79, GPU has fallen off the bus.",
        "[Tue Aug  4 14:21:58 2026] NVRM: Xid (PCI:0000:3B:00): 79, GPU has fallen off the bus.",
    ],
)
def test_prefix_forms(line: str) -> None:
    x = parse_line(line)
    assert x is not None
    assert (x.xid, x.pci, x.pid, x.process, x.detail) == (
        79, "0000:3b:00", None, None, "GPU has fallen off the bus.")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 95, pid='<unknown>'", (95, None, None, "")),
        ("NVRM: Xid (PCI:0000:65:00): 74, pid=<n/a>, name=<unknown>, NVLink: fatal error",
         (74, None, None, "NVLink: fatal error")),
        ("NVRM: Xid (PCI:000f:01:00): 119, Timeout after 6s of waiting for RPC response",
         (119, None, None, "Timeout after 6s of waiting for RPC response")),
        ("NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:00): 31, pid=12345, name=python, x",
         (31, "12345", "python", "x")),
        ("NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
         (154, None, None, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)")),
        ("NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000)",
         (149, None, None, "NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000)")),
    ],
)
def test_line_variants(line: str, expected: tuple[object, ...]) -> None:
    x = parse_line(line)
    assert x is not None
    assert (x.xid, x.pid, x.process, x.detail) == expected


@pytest.mark.parametrize(
    ("bus", "pci"),
    [
        ("PCI:0000:3b:00 GPU-I:01 GPU-CI:00", "0000:3b:00"),  # MIG instance suffix
        ("PCI:0018:01:00", "0018:01:00"),
        ("PCI:0000:10:1c", "0000:10:1c"),
        ("PCI:0000:0f:00.0", "0000:0f:00"),
    ],
)
def test_bus_id_forms(bus: str, pci: str) -> None:
    x = parse_line(f"NVRM: Xid ({bus}): 31, x")
    assert x is not None and x.pci == pci


@pytest.mark.parametrize(
    "line",
    [
        "",
        "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:3b:00): abc, pid=1",
        "NVRM: Xid (79): GPU has fallen off the bus on nvidia1",
        "NVRM: Xid (PCI:zz:3b:00): 79, x",
        "NVRM: Xid (PCI:0000:3b:00) 79, missing colon",
        "NVRM: Xid",
        "nvidia-nvlink: Nvlink Core is being initialized",
    ],
)
def test_not_an_xid(line: str) -> None:
    assert parse_line(line) is None


def test_verdicts_of_recorded_xids() -> None:
    xids = parse_text((DATA / "dmesg.log").read_text(encoding="utf-8"))
    drains = sorted({x.xid for x in xids if lookup(x.xid).drains})
    warns = sorted({x.xid for x in xids if not lookup(x.xid).drains})
    assert drains == [48, 64, 74, 79, 95, 119, 120]
    assert warns == [13, 31, 63, 92, 94]


# --- PCI ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nvrm", "nvml"),
    [
        ("0000:3b:00", "00000000:3B:00.0"),
        ("0008:01:00", "00000008:01:00.0"),
        ("0000:10:1c", "00000000:10:1C.0"),
        ("PCI:0000:b7:00", "0000:b7:00.0"),
    ],
)
def test_normalize_pci_matches_nvml(nvrm: str, nvml: str) -> None:
    assert normalize_pci(nvrm) == normalize_pci(nvml)
    assert normalize_pci(nvml) == normalize_pci(nvml).lower()
    assert len(normalize_pci(nvml)) == 10


def test_normalize_pci_values() -> None:
    assert normalize_pci("00000000:3B:00.0") == "0000:3b:00"
    assert normalize_pci(" 0000:3b:00 ") == "0000:3b:00"
    assert normalize_pci("0:3b:0") == "0000:3b:00"
    assert normalize_pci("not a bus id") == "not a bus id"
    assert normalize_pci("") == ""


def test_map_to_gpus() -> None:
    gpus = [
        GpuState(index=0, pci_bus_id="00000000:18:00.0"),
        GpuState(index=1, pci_bus_id="00000000:3B:00.0"),
        GpuState(index=2, pci_bus_id=None),
        GpuState(index=3, pci_bus_id="00000000:86:00.0"),
    ]
    xids = parse_text((DATA / "dmesg.log").read_text(encoding="utf-8"))
    mapped = {(x.xid, idx) for idx, x in map_to_gpus(xids, gpus)}
    assert (13, 0) in mapped and (79, 1) in mapped and (48, 3) in mapped
    assert (31, None) in mapped  # 0000:b7:00 is not one of this node's GPUs
    assert map_to_gpus([], gpus) == []


def test_map_to_gpus_accepts_any_object_with_index_and_bus_id() -> None:
    @dataclass(frozen=True)
    class G:
        index: int
        pci_bus_id: str | None

    x = parse_line("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
    assert x is not None
    assert map_to_gpus([x], [G(5, "00000000:3b:00.0")]) == [(5, x)]


# --- FileSource and the cursor ------------------------------------------------------------

XID79 = "[ 99.000001] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
XID13 = "[ 99.000002] NVRM: Xid (PCI:0000:18:00): 13, pid=7, name=python, Graphics Exception\n"
NOISE = "[ 99.000003] EXT4-fs (sda1): re-mounted.\n"


@pytest.fixture()
def log(tmp_path: Path) -> Path:
    p = tmp_path / "kern.log"
    p.write_text((DATA / "dmesg.log").read_text(encoding="utf-8"), encoding="utf-8")
    return p


def _append(p: Path, text: str) -> None:
    with open(p, "a", encoding="utf-8") as fh:
        fh.write(text)


def test_each_xid_is_returned_once(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = read_new(FileSource(log), state, boot_id=BOOT)
    assert [x.xid for x in first] == XID_CODES
    assert read_new(FileSource(log), state, boot_id=BOOT) == []
    assert read_new(FileSource(log), state, boot_id=BOOT) == []


def test_cursor_file_format(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    read_new(FileSource(log), state, boot_id=BOOT)
    data = json.loads((state / "kernlog.cursor").read_text(encoding="utf-8"))
    assert data == {"boot_id": BOOT, "source": f"file:{log}", "position": log.stat().st_size}
    assert sorted(os.listdir(state)) == ["kernlog.cursor", "kernlog.lock"]  # no temp files


def test_appended_lines_are_returned(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    read_new(FileSource(log), state, boot_id=BOOT)
    _append(log, NOISE + XID13 + NOISE)
    assert [x.xid for x in read_new(FileSource(log), state, boot_id=BOOT)] == [13]
    _append(log, XID79)
    assert [x.xid for x in read_new(FileSource(log), state, boot_id=BOOT)] == [79]
    assert read_new(FileSource(log), state, boot_id=BOOT) == []


def test_incomplete_line_waits_for_its_newline(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    read_new(FileSource(log), state, boot_id=BOOT)
    _append(log, XID79[:40])
    assert read_new(FileSource(log), state, boot_id=BOOT) == []
    _append(log, XID79[40:])
    got = read_new(FileSource(log), state, boot_id=BOOT)
    assert [x.xid for x in got] == [79]
    assert got[0].raw == XID79.rstrip("\n")


def test_new_process_still_skips_judged_xids(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    read_new(FileSource(log), state, boot_id=BOOT)
    _append(log, XID13)
    code = textwrap.dedent(
        """
        import sys
        from slurmagent.gpu.kernlog import FileSource, read_new
        xids = read_new(FileSource(sys.argv[1]), sys.argv[2], boot_id=sys.argv[3])
        print(",".join(str(x.xid) for x in xids))
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-c", code, str(log), str(state), BOOT]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True)
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert first.stdout.strip() == "13"
    assert again.stdout.strip() == ""


def test_truncation_restarts_at_zero(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    read_new(FileSource(log), state, boot_id=BOOT)
    log.write_text(XID13, encoding="utf-8")  # rotated: a new, shorter file
    assert [x.xid for x in read_new(FileSource(log), state, boot_id=BOOT)] == [13]
    assert read_new(FileSource(log), state, boot_id=BOOT) == []


def test_new_boot_restarts(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    read_new(FileSource(log), state, boot_id=BOOT)
    again = read_new(FileSource(log), state, boot_id="another-boot")
    assert [x.xid for x in again] == XID_CODES
    assert load_cursor(state) == Cursor("another-boot", f"file:{log}", log.stat().st_size)


def test_boot_id_is_read_from_proc_by_default(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    read_new(FileSource(log), state)
    assert load_cursor(state).boot_id == host.boot_id()  # type: ignore[union-attr]
    assert read_new(FileSource(log), state) == []
    fake = tmp_path / "boot_id"
    fake.write_text("abc\n", encoding="ascii")
    assert host.boot_id(str(fake)) == "abc"
    assert host.boot_id(str(tmp_path / "missing")) == ""


def test_peek_does_not_advance(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert [x.xid for x in read_new(FileSource(log), state, commit=False, boot_id=BOOT)] == XID_CODES
    assert not (state / "kernlog.cursor").exists()
    assert len(read_new(FileSource(log), state, commit=False, boot_id=BOOT)) == len(XID_CODES)
    assert len(read_new(FileSource(log), state, boot_id=BOOT)) == len(XID_CODES)
    _append(log, XID13)
    assert [x.xid for x in read_new(FileSource(log), state, commit=False, boot_id=BOOT)] == [13]
    assert [x.xid for x in read_new(FileSource(log), state, commit=False, boot_id=BOOT)] == [13]


def test_read_judge_commit(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    batch = read_since(FileSource(log), state, boot_id=BOOT)
    assert [x.xid for x in batch.xids] == XID_CODES
    # judging failed: nothing committed, so the same XIDs come back
    assert [x.xid for x in read_since(FileSource(log), state, boot_id=BOOT).xids] == XID_CODES
    commit_cursor(state, batch.cursor)
    assert read_since(FileSource(log), state, boot_id=BOOT).xids == []


def test_other_source_starts_over(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    read_new(FileSource(log), state, boot_id=BOOT)
    other = tmp_path / "other.log"
    other.write_text(XID79, encoding="utf-8")
    assert [x.xid for x in read_new(FileSource(other), state, boot_id=BOOT)] == [79]


@pytest.mark.parametrize(
    "content",
    ["", "{not json", "[]", '{"boot_id": 1}', '{"boot_id": "b", "source": "s", "position": 1.5}',
     '{"boot_id": "b", "source": "s", "position": true}'],
)
def test_unreadable_cursor_means_start_over(log: Path, tmp_path: Path, content: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "kernlog.cursor").write_text(content, encoding="utf-8")
    assert load_cursor(state) is None
    assert len(read_new(FileSource(log), state, boot_id=BOOT)) == len(XID_CODES)
    assert load_cursor(state) is not None


def test_missing_file_reads_empty(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path = tmp_path / "not-yet.log"
    assert read_new(FileSource(path), state, boot_id=BOOT) == []
    path.write_text(XID79, encoding="utf-8")
    assert [x.xid for x in read_new(FileSource(path), state, boot_id=BOOT)] == [79]


def test_undecodable_bytes_are_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_bytes(b"\xff\xfe garbage \x00\n" + XID79.encode() + b"\xc3(\n")
    xids = read_new(FileSource(path), tmp_path / "s", boot_id=BOOT)
    assert [x.xid for x in xids] == [79]


def test_unwritable_state_dir_is_a_clear_error(log: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    with pytest.raises(KernlogError):
        read_new(FileSource(log), blocker / "state", boot_id=BOOT)


# --- KmsgSource ---------------------------------------------------------------------------


def test_kmsg_records(tmp_path: Path) -> None:
    src = KmsgSource(str(DATA / "kmsg.txt"))
    state = tmp_path / "state"
    xids = read_new(src, state, boot_id=BOOT)
    assert _summary(xids) == EXPECTED
    cursor = load_cursor(state)
    assert cursor is not None and cursor.position == 1524 and cursor.source.startswith("kmsg:")
    assert read_new(src, state, boot_id=BOOT) == []


def test_kmsg_skips_seen_sequence_numbers(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text(
        "4,10,100,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n"
        " SUBSYSTEM=pci\n"
        " DEVICE=+pci:0000:3b:00.0\n"
        "4,11,200,-;NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=p, Graphics Exception\n"
        "4,12,300,c;NVRM: Xid (PCI:0000:18:00): 31, partial record without newline",
        encoding="utf-8",
    )
    lines, pos = KmsgSource(str(path)).read(10)
    assert pos == 11
    assert [x.xid for x in parse_lines(lines)] == [13]
    assert KmsgSource(str(path)).read(11) == ([], 11)
    assert KmsgSource(str(path)).read(None)[1] == 11


def test_kmsg_missing_device_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KernlogError):
        KmsgSource(str(tmp_path / "nope")).read(None)


@pytest.mark.skipif(not kernlog.kmsg_readable(), reason="/dev/kmsg is not readable here")
def test_real_kmsg_is_read_without_blocking(tmp_path: Path) -> None:
    state = tmp_path / "state"
    read_new(KmsgSource(), state)
    cursor = load_cursor(state)
    assert cursor is not None and cursor.source == "kmsg" and isinstance(cursor.position, int)
    read_new(KmsgSource(), state)  # a second read returns at EAGAIN, too


# --- JournalSource ------------------------------------------------------------------------


def _fake_tool(tmp_path: Path, name: str, body: str) -> Path:
    tool = tmp_path / name
    tool.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body), encoding="utf-8")
    tool.chmod(0o755)
    return tool


FAKE_JOURNALCTL = """
    import json, sys
    from pathlib import Path
    here = Path(__file__).parent
    with open(here / "argv.log", "a") as fh:
        fh.write(json.dumps(sys.argv[1:]) + "\\n")
    after = None
    for arg in sys.argv[1:]:
        if arg.startswith("--after-cursor="):
            after = arg.split("=", 1)[1]
    entries = [json.loads(l) for l in (here / "journal.jsonl").read_text().splitlines()]
    if after is not None:
        cursors = [e["__CURSOR"] for e in entries]
        if after not in cursors:
            print("Failed to seek to cursor: Invalid argument", file=sys.stderr)
            sys.exit(1)
        entries = entries[cursors.index(after) + 1:]
    for e in entries:
        print(json.dumps(e))
"""


@pytest.fixture()
def journal(tmp_path: Path) -> tuple[JournalSource, Path]:
    tool_dir = tmp_path / "bin"
    tool_dir.mkdir()
    (tool_dir / "journal.jsonl").write_text(
        (DATA / "journal.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    return JournalSource(str(_fake_tool(tool_dir, "journalctl", FAKE_JOURNALCTL))), tool_dir


def _argv_log(tool_dir: Path) -> list[list[str]]:
    lines = (tool_dir / "argv.log").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def test_journal_source(journal: tuple[JournalSource, Path], tmp_path: Path) -> None:
    src, tool_dir = journal
    state = tmp_path / "state"
    xids = read_new(src, state, boot_id=BOOT)
    assert _summary(xids) == EXPECTED  # incl. the MESSAGE stored as a byte array (xid 92)
    entries = (tool_dir / "journal.jsonl").read_text(encoding="utf-8").splitlines()
    last_cursor = json.loads(entries[-1])["__CURSOR"]
    assert load_cursor(state) == Cursor(BOOT, "journal", last_cursor)
    assert read_new(src, state, boot_id=BOOT) == []
    calls = _argv_log(tool_dir)
    assert calls[0][:5] == ["-k", "-b", "-o", "json", "--no-pager"]
    assert not any(a.startswith("--after-cursor") for a in calls[0])
    assert calls[1][-1] == f"--after-cursor={last_cursor}"


def test_journal_appended_entries(journal: tuple[JournalSource, Path], tmp_path: Path) -> None:
    src, tool_dir = journal
    state = tmp_path / "state"
    read_new(src, state, boot_id=BOOT)
    entry = {"__CURSOR": "s=6f1b2c3d4e5f;i=ffff", "MESSAGE": XID79.split("] ", 1)[1].rstrip()}
    with open(tool_dir / "journal.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")
    assert [x.xid for x in read_new(src, state, boot_id=BOOT)] == [79]
    assert load_cursor(state).position == "s=6f1b2c3d4e5f;i=ffff"  # type: ignore[union-attr]


def test_journal_rejected_cursor_rereads_the_boot(
    journal: tuple[JournalSource, Path], tmp_path: Path
) -> None:
    src, _ = journal
    state = tmp_path / "state"
    commit_cursor(state, Cursor(BOOT, "journal", "s=garbage"))
    assert len(read_new(src, state, boot_id=BOOT)) == len(XID_CODES)


def test_journal_failure_and_timeout(tmp_path: Path) -> None:
    broken = _fake_tool(tmp_path, "broken", "import sys\nprint('No journal files', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(KernlogError, match="exit 3.*No journal files"):
        JournalSource(str(broken)).read(None)
    slow = _fake_tool(tmp_path, "slow", "import time\ntime.sleep(30)\n")
    with pytest.raises(KernlogError, match="did not answer"):
        JournalSource(str(slow), timeout=0.5).read(None)
    with pytest.raises(KernlogError, match="cannot run"):
        JournalSource(str(tmp_path / "absent")).read(None)


# --- DmesgSource and default_source -------------------------------------------------------


def test_dmesg_source(tmp_path: Path) -> None:
    out = tmp_path / "dmesg.out"
    out.write_text((DATA / "dmesg.log").read_text(encoding="utf-8"), encoding="utf-8")
    tool = _fake_tool(tmp_path, "dmesg", f"import sys\nsys.stdout.write(open({str(out)!r}).read())\n")
    src = DmesgSource(str(tool))
    state = tmp_path / "state"
    assert [x.xid for x in read_new(src, state, boot_id=BOOT)] == XID_CODES
    assert read_new(src, state, boot_id=BOOT) == []
    _append(out, NOISE + XID13)
    assert [x.xid for x in read_new(src, state, boot_id=BOOT)] == [13]
    out.write_text(XID79, encoding="utf-8")  # ring buffer cleared (dmesg -c)
    assert [x.xid for x in read_new(src, state, boot_id=BOOT)] == [79]


def test_default_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernlog, "kmsg_readable", lambda path="/dev/kmsg": True)
    assert isinstance(kernlog.default_source(), KmsgSource)
    monkeypatch.setattr(kernlog, "kmsg_readable", lambda path="/dev/kmsg": False)
    monkeypatch.setattr(kernlog.shutil, "which", lambda name: "/usr/bin/journalctl")
    src = kernlog.default_source()
    assert isinstance(src, JournalSource) and src.journalctl == "/usr/bin/journalctl"
    monkeypatch.setattr(kernlog.shutil, "which", lambda name: None)
    assert isinstance(kernlog.default_source(), DmesgSource)


def test_source_for_config(tmp_path: Path) -> None:
    src = kernlog.source_for(str(tmp_path / "k.log"))
    assert isinstance(src, FileSource)


def test_nothing_runs_at_import() -> None:
    code = (
        "import subprocess, builtins\n"
        "def boom(*a, **k): raise AssertionError('ran at import')\n"
        "subprocess.run = subprocess.Popen = boom\n"
        "import slurmagent.gpu.kernlog, slurmagent.core.xid\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


# --- fuzz ---------------------------------------------------------------------------------

_hex = st.text("0123456789abcdefABCDEF", min_size=1, max_size=9)
_pieces = st.sampled_from([
    "NVRM: Xid (", "PCI:", "0000:3b:00", "00000000:3B:00.0", "): ", "79", ", ", "pid=",
    "'<unknown>'", "name=", "python", "\n", "\r", "\x00", "(", ")", ":", ",", " ", "\u2028",
    "GPU-I:01", "[ 1.0] ", "6,1,2,-;", "Nov 30 05:00:00 h kernel: ",
])
_structured = st.lists(st.one_of(_pieces, _hex, st.text(max_size=8)), max_size=20).map("".join)


def _well_typed(x: KernelXid) -> None:
    assert isinstance(x.xid, int) and x.xid >= 0
    assert isinstance(x.pci, str) and isinstance(x.detail, str) and isinstance(x.raw, str)
    assert x.pid is None or isinstance(x.pid, str)
    assert x.process is None or isinstance(x.process, str)
    assert "\n" not in x.raw and "\n" not in x.detail


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(), _structured))
def test_fuzz_parse_line(line: str) -> None:
    x = parse_line(line)
    if x is not None:
        _well_typed(x)
        assert "NVRM: Xid (" in x.raw


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.text(), _structured), max_size=10).map("\n".join))
def test_fuzz_parse_text(text: str) -> None:
    for x in parse_text(text):
        _well_typed(x)


@settings(max_examples=200)
@given(st.text(max_size=30))
def test_fuzz_normalize_pci(s: str) -> None:
    out = normalize_pci(s)
    assert isinstance(out, str)
    assert normalize_pci(out) == out


@settings(max_examples=100)
@given(_hex, _hex, _hex)
def test_fuzz_nvrm_and_nvml_forms_agree(d: str, b: str, dev: str) -> None:
    dom, bus, device = int(d[:4], 16), int(b[:2], 16), int(dev[:2], 16)
    nvrm = f"{dom:04x}:{bus:02x}:{device:02x}"
    nvml = f"{dom:08X}:{bus:02X}:{device:02X}.0"
    assert normalize_pci(nvrm) == normalize_pci(nvml) == nvrm
    line = f"NVRM: Xid (PCI:{nvrm}): 79, GPU has fallen off the bus."
    assert parse_line(line).pci == normalize_pci(nvml)  # type: ignore[union-attr]
