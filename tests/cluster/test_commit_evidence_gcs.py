"""Never starved, never mixed (issue 35): a periodic commit takes a folder's files by
evidence (closed, unchanged across the round's upload, one save's files settled), not after
a whole quiet round. The real `slurmagent run` (a Cloud Run task) against the emulator, with
plain trainers that save the way people write them.

* An atomic saver (temporary name, rename) with a log appended beside it: before, the log
  changed every round, the folder was never quiet for a whole round, and no periodic commit
  happened in the whole run; now the first rounds commit it.
* A saver faster than the sync round: every committed version is one whole save.
* A model and its optimizer saved one after the other (each atomically): no commit pairs a
  model of one step with an optimizer of another.
* The same with a gap between the two files longer than `settle_s` (where timing alone would
  pair them wrongly), declared with `trainer.saved([...], step=N)`: every commit is one step's
  pair, and commits keep coming although the folder is never quiet for `settle_s` in a round.
"""

from __future__ import annotations

import time

from slurmagent.checkpoint.manifest import entry_content_id
from support import kill_process_tree, wait_for
from test_torn_saves_gcs import start

# Saves ckpt.pt atomically every argv[2] seconds (its content names the step and fills 200 kB),
# appends a line to train.log (held open, as logging's FileHandler does) every 0.05 s.
ATOMIC_WITH_LOG = r'''
import os, sys, time
d, period = os.environ["SLURMAGENT_CKPT_DIR"], float(sys.argv[2])
log = open(os.path.join(d, "train.log"), "a", buffering=1)
step, next_save = 0, 0.0
while True:
    log.write(f"step {step} loss 0.1\n")
    if time.monotonic() >= next_save:
        tmp = os.path.join(d, "ckpt.pt.tmp")
        with open(tmp, "wb") as f:
            f.write(f"step={step};".encode().ljust(200_000, b"."))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(d, "ckpt.pt"))
        next_save = time.monotonic() + period
    step += 1
    time.sleep(0.05)
'''

# model.pt, then 0.1 s later optim.pt, each saved atomically, every 1.1 s; a log beside them.
TWO_FILES = r'''
import os, sys, time
d = os.environ["SLURMAGENT_CKPT_DIR"]
log = open(os.path.join(d, "train.log"), "a", buffering=1)
def save(name, step):
    tmp = os.path.join(d, name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(f"step={step};".encode().ljust(100_000, b"."))
    os.replace(tmp, os.path.join(d, name))
step = 0
while True:
    step += 1
    log.write(f"step {step}\n")
    save("model.pt", step)
    time.sleep(0.1)
    save("optim.pt", step)
    time.sleep(1.0)
'''


# model.pt, then 0.5 s later optim.pt, each saved atomically, then declared as one set; 0.3 s
# later the next save. A log beside them.
DECLARED_PAIRS = r'''
import os, sys, time
from slurmagent import trainer
d = os.environ["SLURMAGENT_CKPT_DIR"]
log = open(os.path.join(d, "train.log"), "a", buffering=1)
def save(name, step):
    tmp = os.path.join(d, name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(f"step={step};".encode().ljust(100_000, b"."))
    os.replace(tmp, os.path.join(d, name))
step = 0
while True:
    step += 1
    log.write(f"step {step}\n")
    save("model.pt", step)
    time.sleep(0.5)
    save("optim.pt", step)
    trainer.saved(["model.pt", "optim.pt"], step=step)
    time.sleep(0.3)
'''


def step_of(data: bytes) -> int:
    return int(data.split(b";", 1)[0].split(b"=")[1])


def stop(proc) -> None:
    """The wrapper and its trainer (in a session of its own) killed at once."""
    kill_process_tree(proc.pid)
    proc.wait(10)


def test_an_atomic_save_with_a_log_beside_it_is_committed_by_the_periodic_sync(emu, tmp_path):
    proc, _marks, err, store = start(tmp_path, "atomic-log", sync_interval=0.5, code=ATOMIC_WITH_LOG, then="1.0")
    try:
        wait_for(lambda: (m := store.latest_manifest()) is not None and "ckpt.pt" in m.files, 30,
                 "a periodic commit holding ckpt.pt: " + err.read_text()[-2000:])
        first = store.latest_manifest()
        time.sleep(3.0)  # six rounds, three saves
        later = store.latest_manifest()
        assert later.files["ckpt.pt"] != first.files["ckpt.pt"], err.read_text()  # newer saves keep coming
    finally:
        stop(proc)
    restored = tmp_path / "restored"
    store.restore(restored, deadline_s=60)
    data = (restored / "ckpt.pt").read_bytes()
    assert len(data) == 200_000 and step_of(data) > 0
    assert "train.log" in later.files  # the log is committed as it was, never holding the rest back


def test_a_saver_faster_than_the_sync_round_is_committed_whole(emu, tmp_path):
    proc, _marks, err, store = start(tmp_path, "fast", sync_interval=0.5, code=ATOMIC_WITH_LOG, then="0.05")
    seen = set()
    try:
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            m = store.latest_manifest()
            if m is not None and "ckpt.pt" in m.files:
                seen.add(m.files["ckpt.pt"]["size"])
            time.sleep(0.2)
    finally:
        stop(proc)
    assert seen == {200_000}, (seen, err.read_text()[-2000:])  # committed, and never a part of a save
    restored = tmp_path / "restored"
    store.restore(restored, deadline_s=60)
    assert len((restored / "ckpt.pt").read_bytes()) == 200_000


def committed_pairs(store, tmp_path, err, seconds: float) -> int:
    """Restore every new commit seen within `seconds`; assert its model and optimizer are of one
    step; the number of commits checked."""
    checked, generations = 0, set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        m = store.latest_manifest()
        if m is None or "model.pt" not in m.files or "optim.pt" not in m.files:
            time.sleep(0.1)
            continue
        key = (entry_content_id(m.files["model.pt"]), entry_content_id(m.files["optim.pt"]))
        if key not in generations:
            generations.add(key)
            restored = tmp_path / f"restored{len(generations)}"
            got = store.restore(restored, deadline_s=60)
            if got is not None and (restored / "optim.pt").exists():
                model, optim = (restored / "model.pt").read_bytes(), (restored / "optim.pt").read_bytes()
                assert step_of(model) == step_of(optim), (step_of(model), step_of(optim), err.read_text()[-2000:])
                checked += 1
        time.sleep(0.1)
    return checked


def test_a_declared_pair_saved_further_apart_than_settle_s_is_committed_whole_and_never_mixed(emu, tmp_path):
    # settle 0.25 s, but 0.5 s between one save's files: only the trainer's word keeps them together
    proc, _marks, err, store = start(tmp_path, "declared", sync_interval=0.3, code=DECLARED_PAIRS, settle_s=0.25)
    try:
        checked = committed_pairs(store, tmp_path, err, 10.0)
    finally:
        stop(proc)
    assert checked >= 3, (checked, err.read_text()[-2000:])  # commits kept coming, each one save's pair


def test_two_files_of_one_save_are_never_committed_from_different_steps(emu, tmp_path):
    # settle 0.25 s: longer than the 0.1 s between one save's files, shorter than the 1 s between saves
    proc, _marks, err, store = start(tmp_path, "pairs", sync_interval=0.3, code=TWO_FILES, settle_s=0.25)
    try:
        checked = committed_pairs(store, tmp_path, err, 10.0)
    finally:
        stop(proc)
    assert checked >= 3, (checked, err.read_text()[-2000:])  # commits kept coming, each one save's pair
