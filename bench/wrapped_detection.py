#!/usr/bin/env python3
"""Time of the wrapped-job detection on adversarial batch scripts, beside the regex it replaced.

Usage: python bench/wrapped_detection.py [--max-baseline-kb 100]
The detection reads a user's batch script as root (prolog guard, expiry flush). The script
is `exec slurmagent slurmagent ... slurmagent x` on one line (no `run`): the old regex tries
every `slurmagent` word against every later word, quadratic in the line; the word scan is one
pass. The baseline stops at --max-baseline-kb (it takes minutes beyond); the scan goes to
Slurm's 4 MB script limit.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slurmagent.slurm.model import script_execs_wrapper  # noqa: E402

# The detection before: one regex over the whole script (kept here as the baseline only).
OLD_REGEX = re.compile(
    r"^[ \t]*exec[ \t]+(?:[^\s#]\S*[ \t]+)*?[^\s#]*slurmagent(?:\.entry|\.cli)?[ \t]+(?:[^\s#]\S*[ \t]+)*?run(?:\s|$)",
    re.M)


def adversarial(size: int) -> str:
    return "#!/bin/sh\nexec " + "slurmagent " * (size // 11) + "x\n"


def timed(fn, script: str) -> float:
    t = time.perf_counter()
    assert not fn(script)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-baseline-kb", type=int, default=100)
    args = ap.parse_args()
    print(f"{'script':>8}  {'regex (before)':>15}  {'word scan':>10}")
    for kb in (12, 25, 50, 100, 200, 400, 1024, 4096):
        script = adversarial(kb * 1024)
        scan = timed(script_execs_wrapper, script)
        before = f"{timed(lambda s: OLD_REGEX.search(s), script):14.3f}s" if kb <= args.max_baseline_kb else \
            f"{'(skipped)':>15}"
        print(f"{kb:>6}KB  {before}  {scan:9.4f}s")


if __name__ == "__main__":
    main()
