#!/usr/bin/env python3
"""Requests per sync: what checking that a commit's blobs exist (slurmagent.checkpoint.gcs.verify) costs.

    python bench/sync_requests.py [--big N] [--small N]

Starts its own fake-gcs-server, commits a checkpoint of N big files (2 MiB, one blob each) and
N small ones (4 KiB, in packs), then counts the HTTP requests of: the first sync of a new run
(a new store, nothing changed: every referenced object is checked once), the next unchanged
sync of the same run (nothing is checked again), and a node agent's round in the same run (a
new store each round, the run's set read from the state file).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slurmagent.devtools.localgcs import GcsEmulator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", type=int, default=16)
    ap.add_argument("--small", type=int, default=2000)
    args = ap.parse_args()
    emu = GcsEmulator().start()
    try:
        emu.create_bucket("ckpt")
        os.environ["STORAGE_EMULATOR_HOST"] = emu.url
        from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
        from slurmagent.checkpoint.gcs.bucket import make_client

        root = Path(tempfile.mkdtemp())
        ckpt, state = root / "ckpt", root / "state.json"
        ckpt.mkdir()
        for i in range(args.big):
            (ckpt / f"shard-{i}.pt").write_bytes(os.urandom(2 << 20))
        for i in range(args.small):
            (ckpt / f"s-{i}").write_bytes(os.urandom(4096))
        old = 1e9
        for p in ckpt.iterdir():
            os.utime(p, (old, old))
        GcsCheckpointStore("gs://ckpt/b").sync(ckpt, 0, state, 300)

        def counted(**kw):
            client, calls = make_client(), []
            client._http.hooks["response"].append(lambda r, *a, **k: calls.append(r.request.method))
            return GcsCheckpointStore("gs://ckpt/b", client=client, **kw), calls

        s, calls = counted()
        s.sync(ckpt, 1, state, 300)
        first = len(calls)
        calls.clear()
        s.sync(ckpt, 1, state, 300)
        print(f"{args.big} big + {args.small} small files, {len(s.seen)} objects referenced:")
        print(f"  first sync of a run (unchanged files): {first} requests")
        print(f"  next unchanged sync of the same run:   {len(calls)} requests")
        for round_no in range(2):
            a, calls = counted(run_id="42")
            a.sync(ckpt, 2, state, 300, commit=False)
            print(f"  node agent, round {round_no + 1} of a run (new process): {len(calls)} requests")
    finally:
        emu.stop()


if __name__ == "__main__":
    main()
