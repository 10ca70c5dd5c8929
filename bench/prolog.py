#!/usr/bin/env python3
"""Whole-process time of `slurmagent prolog` on a healthy 8-GPU replay, beside bare Python.

Usage: python bench/prolog.py [--runs 21]
Prints the medians side by side, the ratio (target < 4x bare start-up) and the modules the
healthy path imports beyond bare Python (target: no google.*, no click).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def timed(argv: list[str], env: dict[str, str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        out.append(time.perf_counter() - t)
        if proc.returncode != 0:
            raise SystemExit(f"{argv} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21)
    args = ap.parse_args()
    from support import healthy_snapshot_dict

    tmp = Path(tempfile.mkdtemp(prefix="sa-bench-"))
    try:
        (tmp / "snap.json").write_text(json.dumps(healthy_snapshot_dict(8)))
        (tmp / "kern.log").write_text("[   1.0] Linux version 6.1\n" * 2000)
        (tmp / "config.toml").write_text(
            f'state_dir = "{tmp}/state"\n[health]\nsnapshot = "{tmp}/snap.json"\n'
            f'kernel_log = "{tmp}/kern.log"\nexpected_gpus = 8\n[hooks]\nsyslog = false\n'
        )
        env = dict(os.environ, SLURMAGENT_CONFIG=str(tmp / "config.toml"), SLURMD_NODENAME="n1",
                   SLURM_JOB_ID="1", PYTHONPATH=str(REPO))
        script = shutil.which("slurmagent", path=str(Path(sys.executable).parent)) or ""
        prolog = [script, "prolog"] if script else [sys.executable, "-m", "slurmagent.entry", "prolog"]
        bare = [sys.executable, "-c", "pass"]
        timed(prolog, env, 2)  # warm the page cache and the .pyc files
        base, hook = [], []
        for _ in range(args.runs):  # interleave so drift hits both alike
            base += timed(bare, env, 1)
            hook += timed(prolog, env, 1)
        probe = (
            "import sys; before=set(sys.modules); from slurmagent.entry import main; rc=main(['prolog']);"
            "print(rc); print('\\n'.join(sorted(set(sys.modules)-before)))"
        )
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        rc, *mods = out.stdout.split()
        mb, mh = statistics.median(base) * 1000, statistics.median(hook) * 1000
        print(f"{'':<34}{'median ms':>10}{'min ms':>10}")
        print(f"{'python -c pass (baseline)':<34}{mb:>10.1f}{min(base) * 1000:>10.1f}")
        print(f"{'slurmagent prolog (healthy, 8 GPU)':<34}{mh:>10.1f}{min(hook) * 1000:>10.1f}")
        print(f"ratio: {mh / mb:.2f}x bare Python start-up (target < 4x), {args.runs} runs each, exit code {rc}")
        ours = [m for m in mods if m.startswith("slurmagent")]
        other = [m for m in mods if not m.startswith("slurmagent")]
        bad = [m for m in mods if m.startswith(("google", "click", "pynvml"))]
        print(f"modules imported by the healthy path: {len(mods)} ({len(ours)} slurmagent): {' '.join(ours)}")
        print(f"  other: {' '.join(other)}")
        print(f"  google/click/pynvml imported: {bad or 'none'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
