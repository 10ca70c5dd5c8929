"""Checkpoint identity: which checkpoint under a job's prefix is this submission's own.

The default prefix is `[checkpoint] remote` + the Slurm job id (or `<job>-task-<index>` in
Cloud Run), and a job id comes back (a controller redeployed with fresh state, `FirstJobId`,
ids wrapping) as a Cloud Run job name does at every execution. So every manifest names its
`owner`, and the restart count (`attempt`) is compared only within one owner:

* **A submission id is known** -- `SLURMAGENT_SUBMISSION` (put into the batch script by
  `slurmagent sbatch`, so it is the same at every requeue, whatever `--export` says) or the
  Cloud Run execution (`CLOUD_RUN_EXECUTION`: its task retries share it). A manifest of that
  owner is ours, at any attempt; any other one is foreign.
* **Plain `sbatch`** (no submission id): a first attempt (restart count 0) finding a manifest
  under its per-job prefix has found a foreign one; a later attempt (restart count >= 1)
  adopts the owner it finds: attempt 0 took the prefix over before the trainer started, and
  a job requeued across the upgrade finds its own manifest without an owner.
* **Foreign, default prefix**: never restored. Said on stderr; the prefix is taken over at
  once, before the trainer starts: an empty manifest of ours (a claim) replaces the foreign
  one, kept as `superseded/manifest-<generation>.json`. Later attempts find the claim.
* **Foreign, explicit `--remote`**: the user named the checkpoint, so it is resumed: the
  claim holds its files under our owner (the old owner's later writes are then refused).

Pure decision (`decide`) apart from the bucket side (`settle`), which any store offering
`read_manifest`, `claim` and `owner` serves (the single-node and the multi-node store).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol, runtime_checkable

from ..checkpoint.manifest import Manifest
from ..checkpoint.errors import StorageUnavailableError
from ..checkpoint.errors import ClaimRaceError
from ..checkpoint.manifest import OWNER_RE, utc_now_rfc3339

SUBMISSION_ENV = "SLURMAGENT_SUBMISSION"
CLAIM_RACES = 3  # a prefix that keeps changing while we take it over: give up (not starting)


def new_owner() -> str:
    """A fresh owner id: 128 random bits, never seen before under any prefix."""
    return secrets.token_hex(16)


def submission_of(env: Mapping[str, str], platform: str) -> str:
    """This submission's id from the environment ("" when there is none); a malformed one is
    a ValueError (said by the caller in one line)."""
    name = {"slurm": SUBMISSION_ENV, "cloud-run": "CLOUD_RUN_EXECUTION"}.get(platform)
    value = env.get(name, "") if name else ""
    if value and not OWNER_RE.fullmatch(value):
        raise ValueError(f"{name}={value[:40]!r} is not 1-128 letters, digits, '.', '_' or '-'")
    return value


@dataclass(frozen=True)
class Decision:
    action: str  # "fresh" (none there), "ours", "foreign" (refused, claimed empty), "adopt" (resumed, claimed)
    owner: str  # the owner this attempt commits as ("": a checkpoint of before owners, adopted as it is)
    why: str = ""  # one line for stderr


def decide(current: Manifest | None, *, submission: str, restart_count: int, per_job_prefix: bool,
           fresh_owner: Callable[[], str] = new_owner) -> Decision:
    """Whose is `current` (the committed manifest under our prefix), and who do we commit as."""
    if current is None:
        return Decision("fresh", submission or fresh_owner())
    if submission and current.owner == submission:
        return Decision("ours", submission)
    if not submission and restart_count >= 1:
        return Decision("ours", current.owner)  # attempt 0 claimed it, or the upgrade's requeue
    owner = submission or fresh_owner()
    whose = (f"of {current.owner}" if current.owner else "written before checkpoint owners") + \
        f", attempt {current.attempt}, {current.created}"
    if submission:
        because = "another submission's"
    else:
        because = "found by a first attempt (restart count 0), so an earlier job's"
    if not per_job_prefix:
        return Decision("adopt", owner, f"resuming the checkpoint in the explicit --remote ({whose}; {because}) "
                                        f"as this submission ({owner}); its earlier writer can no longer commit there")
    return Decision("foreign", owner, f"NOT restoring the checkpoint under this job's prefix ({whose}): it is "
                                      f"{because}; starting fresh and taking the prefix over as {owner} "
                                      "(the old manifest is kept as superseded/manifest-<generation>.json)")


@runtime_checkable
class OwnedStore(Protocol):
    """A checkpoint store whose commits carry an owner (slurmagent.checkpoint.gcs.store, allocation)."""

    owner: str | None

    def read_manifest(self, *, deadline_s: float = ...) -> tuple[Manifest | None, int]: ...

    def claim(self, manifest: Manifest, over: Manifest | None, generation: int, *, deadline_s: float = ...) -> int: ...


class Attempt(Protocol):
    """Who is starting (run/job.JobIdentity)."""

    submission: str
    restart_count: int


def settle(store, ident: Attempt, per_job_prefix: bool, say: Callable[[str], None],
           deadline_s: float = 60.0) -> Manifest | None:
    """Decide this attempt's checkpoint identity, set the store's owner, take a foreign prefix
    over; return the committed manifest this attempt restores (None: start fresh). A store
    without owners (no remote, a test's fake) just gives its latest manifest."""
    if not isinstance(store, OwnedStore):
        return store.latest_manifest(deadline_s=deadline_s)
    submission, restart_count = ident.submission, ident.restart_count
    for _ in range(CLAIM_RACES):
        current, generation = store.read_manifest(deadline_s=deadline_s)
        d = decide(current, submission=submission, restart_count=restart_count, per_job_prefix=per_job_prefix)
        store.owner = d.owner
        if d.action in ("fresh", "ours"):
            return current if current is not None and current.files else None  # an empty claim: nothing yet
        assert current is not None
        if d.action == "adopt":
            claim = replace(current, attempt=restart_count, created=utc_now_rfc3339(), owner=d.owner,
                            no_progress=0)  # the same files, a new submission's requeue budget
        else:
            claim = Manifest(attempt=restart_count, owner=d.owner)
        try:
            store.claim(claim, current, generation, deadline_s=deadline_s)
        except ClaimRaceError:
            continue  # another writer came first: read and decide again
        say(d.why)
        return claim if claim.files else None
    raise StorageUnavailableError(f"the checkpoint under {getattr(store, 'url', 'the prefix')} kept changing while "
                                  "this job took it over; not starting")
