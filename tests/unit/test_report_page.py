"""`slurmagent report --html`: the page opened in a real headless Chromium (Debian's package)
shows what the JSON says: the ETTR figure and one bar per cause, and its screenshot is a picture,
not a blank page. Without Chromium it skips with one line, except in CI's host lane (`.ci/run`
installs `chromium` there); the Debian chroot lanes (ci/debian-lane.sh: trixie, forky; see
`support.chroot_lane`) have no Chromium and skip.

The same report from a real wrapped job: tests/cluster/test_ledger_slurm.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import zlib

from slurmagent.commands.report import run_report
from slurmagent.state.config import Config
from support import need_tool
from test_goodput import two_attempts

def chromium() -> str:
    # CI's host lane installs it (.ci/run); ci/debian-lane.sh's chroots do not
    return need_tool("chromium", "chromium-browser", install="apt-get install chromium; the report page is not "
                     "checked in a browser without it", chroot_lanes_lack=True)


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of pixels) of an 8-bit RGB/RGBA PNG: chunks, zlib, the five row filters."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, head = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = head
    assert depth == 8 and colour in (2, 6) and interlace == 0, head
    bpp = 3 if colour == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]


def test_the_page_in_chromium_shows_the_ettr_and_one_bar_per_cause(tmp_path):
    browser = chromium()
    page, shot = tmp_path / "report.html", tmp_path / "report.png"
    out = io.StringIO()
    assert run_report(Config(), out, remote="gs://b/p", as_json=True, html=str(page), now=20000.0,
                      reader=lambda remote: (two_attempts(), [])) == 0
    report = json.loads(out.getvalue())
    argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,900"]
    dom = subprocess.run([*argv, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert f'id="ettr" data-ettr="{report["totals"]["ettr"]}"' in html and ">83.7%<" in html
    for cause in report["causes"]:
        assert html.count(f'class="cause-bar" data-cause="{cause}"') == 1, cause
    assert html.count('class="cause-bar"') == len(report["totals"]["lost"])
    assert html.count('class="interruption"') == report["totals"]["interruptions"] == 1
    shot_run = subprocess.run([*argv, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
                              timeout=120)
    assert shot_run.returncode == 0 and shot.exists(), shot_run.stderr[-2000:]
    assert shot.stat().st_size > 10_000  # a blank 1200x900 PNG is ~5 KB
    width, height, pixels = png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 900)
    colours = set(pixels)
    assert len(colours) > 50, len(colours)  # text, bars, timeline: many colours, not a blank page
    assert bytes.fromhex("2e7d32") in colours and bytes.fromhex("c62828") in colours  # progress, recompute
    if os.environ.get("SLURMAGENT_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["SLURMAGENT_KEEP_SCREENSHOT"])
