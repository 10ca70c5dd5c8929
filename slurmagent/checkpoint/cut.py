"""What a periodic commit may take: units, and quiet for a whole round (one node or many).

A trainer writes a checkpoint file by file (the Hugging Face Trainer fills `checkpoint-N/`
in place and writes `trainer_state.json` last; DCP writes its shards, then `.metadata`),
and a sync may look at the directory at any moment. So while the trainer runs, a commit
takes the directory unit by unit, and a unit only once it has been **quiet for a whole
round**: every node's view of it (names, sizes, mtimes, ctimes, inodes of everything in it,
names still being written included) is the same as in the previous round. The content a
round uploaded was hashed between those two looks, so it is the unit as it was, whole, at
one instant between the rounds -- the same instant on every node (a round starts only after
the previous one ended on every node), and no node's clock is ever compared with another's.
A unit that is not quiet keeps its previously committed version (or stays out); after
`SAY_AFTER_ROUNDS` rounds in a row it is said once, until it is taken again. The final sync,
after the trainer exited, takes everything as it is.

**Units** follow how frameworks write:

* a *step folder* -- a folder whose name ends in a number after `-`, `_`, `=` or a step word
  (step, iter, epoch, ckpt, checkpoint), optionally followed by one extension
  (`checkpoint-500`, `step_300`, `step-20`, `global_step100`, `iter_0000100`,
  `epoch=3-step=10.ckpt/`; not `gpt2`, `qwen2.5`) -- is one unit with everything below it;
  the outermost one on a path wins, so HF's `checkpoint-N/pytorch_model_fsdp_0/` goes with
  its `trainer_state.json`.
  Loggers' run folders (`version_N`: Lightning, TensorBoard) are not step folders: they hold
  logs beside checkpoints;
* any other file's unit is the folder it is directly in: the files of one folder go
  together (DCP saved straight into a folder: its `.metadata` with the shards beside it),
  the top level ("") included. So Lightning's `version_0/metrics.csv`, rewritten every
  step, never holds back `version_0/checkpoints/`.

A folder named like a step that is not one checkpoint (`run_2/...`) only makes its
unit coarse: it is committed when everything under it is quiet, and said when held back.

**Rotation** (`Rotations`): a step folder one of its writer nodes removed entirely leaves
the checkpoint whole, whatever other nodes still hold of it: trainers rotate old checkpoints
on global rank 0 only, while the other nodes keep their own ranks' files of them (HF's
`rng_state_1.pth`) and every restored copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .manifest import entry_content_id
from .scan import is_reserved_name, is_temporary_name

SAY_AFTER_ROUNDS = 3  # a unit held back this many rounds in a row is said (once per streak)
NEVER_S = 1e9  # the age of a unit with no file (JSON has no infinity)
SETTLE_S = 0.5  # [checkpoint] settle_s's default: the gap between one save's files (model closed, optimizer not yet opened)

_STEP_FOLDER = re.compile(r"(.*[-_=]|.*(step|iter|epoch|ckpt|checkpoint))\d+(\.[A-Za-z][A-Za-z0-9]*)?", re.IGNORECASE)
_LOGGER_RUN = re.compile(r"version_\d+")


def is_step_folder(name: str) -> bool:
    """A folder that is one checkpoint with everything in it (see module doc)."""
    return _STEP_FOLDER.fullmatch(name) is not None and _LOGGER_RUN.fullmatch(name) is None


def unit_of(relpath: str) -> str:
    """The unit a file belongs to: its outermost step folder, else the folder it is in ("": the top level)."""
    folders = relpath.split("/")[:-1]
    for i, name in enumerate(folders):
        if is_step_folder(name):
            return "/".join(folders[: i + 1])
    return "/".join(folders)


def is_step_unit(unit: str) -> bool:
    """A unit that is a step folder (one checkpoint), not the files of a plain folder."""
    return bool(unit) and is_step_folder(unit.rsplit("/", 1)[-1])


def committed_part(before: dict[str, list[int]], committed: dict[str, list[int]],
                   held_back) -> dict[str, list[int]]:
    """The files as a commit holds them: the scan taken before the sync, except the units the
    commit held back (`unit_of`), which keep what was committed before."""
    held = set(held_back)
    if not held:
        return before
    out = {rel: st for rel, st in before.items() if unit_of(rel) not in held}
    out.update({rel: st for rel, st in committed.items() if unit_of(rel) in held})
    return out


def unit_signatures(ckpt_dir: str | os.PathLike) -> dict[str, str]:
    """Unit -> digest of how it looks on disk now.

    Everything counts, names still being written too (`x.tmp` in `checkpoint-N/` holds it
    back), slurmagent's own working names excepted; nothing is read, only stat'ed."""
    seen = _stat_units(ckpt_dir)
    return {unit: hashlib.sha256(json.dumps(sorted(items)).encode()).hexdigest()[:32] for unit, items in seen.items()}


def unit_files(ckpt_dir: str | os.PathLike) -> dict[str, dict[str, list[int]]]:
    """Unit -> relpath -> [size, mtime_ns, inode] of its files now (names still being written
    included, folders not), for `round_views`."""
    out: dict[str, dict[str, list[int]]] = {}
    for unit, items in _stat_units(ckpt_dir).items():
        out[unit] = {item[0]: list(item[1:4]) for item in items if len(item) > 1}
    return out


def round_views(before: Mapping[str, Mapping[str, list[int]]], after: Mapping[str, Mapping[str, list[int]]],
                skip: Iterable[str] = (), now_ns: int = 0, marks: Mapping[str, str] | None = None) -> dict[str, list]:
    """Unit -> [how it changed across this round's upload, seconds since its newest change,
    its framework mark (`unit_marks`; "" none)]: `stable` (not at all), `replaced` (only files
    swapped for new ones by a rename: an atomic save; each version read was whole) or `changed`
    (a file written in place, added or removed). `skip`: files that only grow (logs open for
    appending) count for neither. `before`/`after`: `unit_files` before and after the upload,
    on one node (one clock)."""
    marks = marks or {}
    skip = set(skip)
    out: dict[str, list] = {}
    for unit in before.keys() | after.keys():
        b = {r: st for r, st in before.get(unit, {}).items() if r not in skip}
        a = {r: st for r, st in after.get(unit, {}).items() if r not in skip}
        if a == b:
            state = "stable"
        elif a.keys() == b.keys() and all(a[r] == b[r] or a[r][2] != b[r][2] for r in a):
            state = "replaced"
        else:
            state = "changed"
        newest = max((st[1] for st in a.values()), default=0)
        out[unit] = [state, round((now_ns - newest) / 1e9, 3) if newest else NEVER_S, marks.get(unit, "")]
    return out


MARKS = (".metadata", "trainer_state.json")  # DCP's index (renamed in last), HF's state (written last, rank 0)
SAFETENSORS_INDEX = ".safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20


def unit_marks(ckpt_dir: str | os.PathLike, after: Mapping[str, Mapping[str, list[int]]]) -> dict[str, str]:
    """Step folder -> what its framework's own mark says on this node: `whole <mark>` (the mark
    is there and nothing in the folder is newer or still under a temporary name) or `partial
    <mark>: <why>` (a save in progress). Folders with no mark are left out. DCP's `.metadata` is
    never unpickled; a safetensors index is read (JSON, bounded) for the shards it names."""
    out: dict[str, str] = {}
    for unit, files in after.items():
        if not is_step_unit(unit):
            continue
        marks = sorted(rel for rel in files if rel.rsplit("/", 1)[-1] in MARKS or rel.endswith(SAFETENSORS_INDEX))
        for mark in marks:
            why = ""
            newer = sorted(r for r, st in files.items() if r != mark and st[1] > files[mark][1])
            temporary = sorted(r for r in files if any(is_temporary_name(p) for p in r.split("/")))
            if temporary:
                why = f"{temporary[0]} is still being written"
            elif newer and not mark.endswith(SAFETENSORS_INDEX):
                why = f"{newer[0]} is newer than {mark}"
            elif mark.endswith(SAFETENSORS_INDEX):
                missing = _missing_shards(ckpt_dir, mark, files)
                why = f"{missing} named by {mark} is not there" if missing else ""
            out[unit] = f"partial {mark}: {why}" if why else f"whole {mark}"
            if why:
                break  # one save in progress is enough to say
    return out


def _missing_shards(ckpt_dir: str | os.PathLike, index: str, files: Mapping[str, list[int]]) -> str:
    folder = index.rsplit("/", 1)[0] + "/" if "/" in index else ""
    try:
        with open(os.path.join(os.fspath(ckpt_dir), index), "rb") as fh:
            raw = fh.read(MAX_INDEX_BYTES + 1)
        shards = set(json.loads(raw)["weight_map"].values()) if len(raw) <= MAX_INDEX_BYTES else {None}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return index  # unreadable or torn: not a mark yet
    for shard in sorted(shards, key=str):
        if not isinstance(shard, str) or folder + shard not in files:
            return str(shard)
    return ""


def _stat_units(ckpt_dir: str | os.PathLike) -> dict[str, list]:
    """Unit -> [[relpath, size, mtime_ns, ctime_ns... ]] of what is in it (the only function
    here that reads the disk)."""
    root = os.fspath(ckpt_dir)
    seen: dict[str, list] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not is_reserved_name(d)]
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        prefix = "" if rel_dir == "." else rel_dir + "/"
        for name in dirnames:
            rel = prefix + name
            if os.path.islink(os.path.join(dirpath, name)):
                filenames.append(name)  # a link to a folder is an entry, never followed
                continue
            seen.setdefault(unit_of(rel + "/-"), []).append([rel + "/"])
        for name in filenames:
            if is_reserved_name(name):
                continue
            rel = prefix + name
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            seen.setdefault(unit_of(rel), []).append([rel, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
    return seen


def content_of(entry: Mapping) -> str:
    """What makes two manifest entries the same file: its content (or link target)."""
    return entry_content_id(dict(entry))


@dataclass
class Cut:
    files: dict[str, dict]
    writers: dict[str, list[int]]
    held_back: list[str] = field(default_factory=list)  # units whose new content this commit leaves out
    messages: list[str] = field(default_factory=list)  # for the job's stderr


class QuietCut:
    """The rounds so far (what each node's units looked like last round, held-back streaks)."""

    def __init__(self, say_after: int = SAY_AFTER_ROUNDS, settle_s: float = SETTLE_S):
        self.say_after = say_after
        self.settle_s = settle_s
        self.last: dict[int, dict[str, str]] | None = None  # node index -> unit -> signature
        self.streaks: dict[str, int] = {}

    def take(self, files: Mapping[str, dict], writers: Mapping[str, list[int]],
             signatures: Mapping[int, Mapping[str, str]], *, previous_files: Mapping[str, dict] | None,
             previous_writers: Mapping[str, list[int]] | None = None, running: bool = True,
             node_names: Mapping[int, str] | None = None, writing: Iterable[str] = (),
             views: Mapping[int, Mapping[str, list]] | None = None, appending: Iterable[str] = (),
             declared: Iterable[list] = ()) -> Cut:
        """The files of this round's commit. `files`/`writers`: everything every node holds now
        (merged); `signatures`: node index -> `unit_signatures` taken after this round's upload;
        `previous_*`: the last commit (what a unit held back keeps); `running`: False for the
        final sync (everything as it is, but torn units); `writing`: files the job's processes
        held open for writing (not appending) after the upload -- or, for the final sync after
        a kill, at the kill: torn. A unit holding one keeps its last committed version.
        `views`: node index -> `round_views` of this round (None: every unit is judged by the
        whole-round rule); `appending`: files open for appending (logs), which hold back nothing;
        `declared`: every node's `saved.declared_sets` (the trainer's word, strongest evidence)."""
        last, self.last = self.last, {i: dict(s) for i, s in signatures.items()}
        open_units = {unit_of(rel): rel for rel in sorted(writing, reverse=True)}
        if not running and not open_units:
            self.streaks.clear()
            return Cut(dict(files), {r: list(w) for r, w in writers.items() if r in files})
        appending = set(appending)
        before = dict(previous_files or {})
        before_writers = dict(previous_writers or {})
        now_by_unit: dict[str, dict[str, dict]] = {}
        for rel, e in files.items():
            now_by_unit.setdefault(unit_of(rel), {})[rel] = e
        before_by_unit: dict[str, dict[str, dict]] = {}
        for rel, e in before.items():
            before_by_unit.setdefault(unit_of(rel), {})[rel] = e
        whole_files, stale_files = _declared_files(declared)
        cut = Cut({}, {})
        for unit in sorted(now_by_unit.keys() | before_by_unit.keys()):
            now, was = now_by_unit.get(unit, {}), before_by_unit.get(unit, {})
            moved: list[int] = []
            why = ""  # a held unit's missing evidence, said after SAY_AFTER_ROUNDS
            keep: set[str] = set()  # files of a unit taken in part that keep their committed version
            if not running:
                hold = unit in open_units
            elif unit in open_units:
                hold, why = True, f"{open_units[unit]} was open for writing at every round; its last committed " \
                                  "version stays until the file is closed"
            elif any(rel in whole_files or rel in stale_files for rel in now.keys() | was.keys()):
                hold, why, keep = self._by_declaration(unit, now, was, views, appending, whole_files, stale_files)
            elif views is not None and is_step_unit(unit) and _marks(views, unit):
                hold, why = _by_mark(unit, views)
            elif views is not None and not is_step_unit(unit):
                hold, why, moved = self._by_evidence(unit, now, was, views, appending)
            else:
                moved = [i for i, sig in signatures.items()
                         if last is None or i not in last or last[i].get(unit) != sig.get(unit)]
                hold = bool(moved)
                if moved:
                    where = ""
                    if node_names is not None:
                        where = " on " + ", ".join(node_names.get(i, f"node index {i}") for i in sorted(moved))
                    why = (f"it changed in every round{where}; its last committed version stays until it is quiet for "
                           "a whole round (a step folder no framework mark covers)")
            if keep:  # taken in part: the sets the trainer declared whole, the rest as committed
                take = {**{r: e for r, e in now.items() if r not in keep}, **{r: was[r] for r in keep if r in was}}
                source = {**writers, **{r: before_writers[r] for r in keep if r in before_writers}}
            else:
                take, source = (now, writers) if not hold else (was, before_writers)
            cut.files.update(take)
            cut.writers.update({rel: list(source[rel]) for rel in take if rel in source})
            differs = _contents(take) != _contents(now)
            if not running:
                if hold and differs:
                    cut.held_back.append(unit)
                    cut.messages.append(
                        f"checkpoint unit {unit or '(top-level files)'} left out of the final commit: "
                        f"{open_units[unit]} was open for writing when the job was stopped (torn); "
                        + ("its last committed version stays" if was else "it was never committed"))
                continue
            if hold and differs:
                cut.held_back.append(unit)
                streak = self.streaks[unit] = self.streaks.get(unit, 0) + 1
                if streak == self.say_after:
                    cut.messages.append(f"checkpoint unit {unit or '(top-level files)'} held back for {streak} "
                                        f"rounds: {why}")
            else:
                self.streaks.pop(unit, None)
        return cut

    def _by_declaration(self, unit: str, now: Mapping[str, dict], was: Mapping[str, dict],
                        views: Mapping[int, Mapping[str, list]] | None, appending: set[str],
                        whole_files: set[str], stale_files: set[str]) -> tuple[bool, str, set[str]]:
        """A unit holding files the trainer declared (`trainer.saved`): a whole set is taken as
        it is; a set with a file rewritten since its declaration keeps its committed version,
        all of its files together. In a step folder every file must be declared (a rank that has
        not said yet holds the step); elsewhere an undeclared file is taken unless it changed
        during this round's upload, and logs always are."""
        stale = {rel for rel in now.keys() | was.keys() if rel in stale_files}
        undeclared = sorted(rel for rel in now if rel not in whole_files and rel not in stale_files
                            and rel not in appending)
        if is_step_unit(unit) and (stale or undeclared):
            what = (f"{sorted(stale)[0]} changed since the trainer declared it saved" if stale else
                    f"{undeclared[0]} is in the step folder but no rank declared it saved (trainer.saved)")
            return True, what + "; its last committed version stays", set()
        changed = views is not None and any(v.get(unit, ["stable"])[0] == "changed" for v in views.values())
        keep = stale | (set(undeclared) if changed else set())
        why = ""
        if stale:
            why = f"{sorted(stale)[0]} changed since the trainer declared it saved; its declared set keeps its " \
                  "last committed version"
        elif keep:
            why = f"{undeclared[0]} (not declared saved) changed during every round's upload"
        return bool(keep), why, keep

    def _by_evidence(self, unit: str, now: Mapping[str, dict], was: Mapping[str, dict],
                     views: Mapping[int, Mapping[str, list]], appending: set[str]) -> tuple[bool, str, list[int]]:
        """Files outside step folders: taken when closed (the caller checked), unchanged across
        this round's upload on every node (an atomic save's rename is no change: each version
        read was whole), and -- when the unit holds more than one file and any changed since the
        last commit -- quiet for `settle_s`: a save half-way through its files (the model new,
        its optimizer not yet) changed only one of them. Logs hold back nothing."""
        seen = {i: v[unit] for i, v in views.items() if unit in v}
        changed = [i for i, v in seen.items() if v[0] == "changed"]
        if changed:
            return True, "it changed during every round's upload (written in place)", changed
        files = [rel for rel in now.keys() | was.keys() if rel not in appending]
        changed_files = [rel for rel in files if rel not in now or rel not in was
                         or content_of(now[rel]) != content_of(was[rel])]
        if not changed_files or len(files) < 2:  # one file: each version read was whole, nothing to pair
            return False, "", []
        young = [i for i, v in seen.items() if v[0] == "replaced" or v[1] < self.settle_s]
        if young:  # a save may be half-way through its files (the model new, its optimizer not yet)
            return True, (f"its files changed and it was never quiet for {self.settle_s:g} s "
                          "(one save's files go together)"), young
        return False, "", []


def _declared_files(declared: Iterable[list]) -> tuple[set[str], set[str]]:
    """(files of sets declared whole on every node, files of sets with one no longer as declared).
    A node's entry: [set key, [relpaths], whole] (`saved.declared_sets`); one set may come from
    several nodes (every rank's files of one step). A file in a whole set is taken, whatever
    older sets say of it."""
    sets: dict[str, tuple[set[str], bool]] = {}
    for entry in declared:
        key, files, whole = entry
        have, ok = sets.get(key, (set(), True))
        sets[key] = (have | set(files), ok and bool(whole))
    whole_files = set().union(*(f for f, ok in sets.values() if ok)) if sets else set()
    stale = set().union(*(f for f, ok in sets.values() if not ok)) if sets else set()
    return whole_files, stale - whole_files


def _marks(views: Mapping[int, Mapping[str, list]], unit: str) -> list[str]:
    return [v[unit][2] for v in views.values() if unit in v and len(v[unit]) > 2 and v[unit][2]]


def _by_mark(unit: str, views: Mapping[int, Mapping[str, list]]) -> tuple[bool, str]:
    """A step folder with its framework's mark (`unit_marks`): taken at once when the mark says
    whole on its node and no node saw the folder change during this round's upload (the open
    files were checked before); a mark that says partial is a save in progress."""
    partial = [m for m in _marks(views, unit) if m.startswith("partial ")]
    if partial:
        return True, f"a save in progress ({partial[0][len('partial '):]})"
    changed = [i for i, v in views.items() if unit in v and v[unit][0] == "changed"]
    if changed:
        return True, "its files changed during every round's upload, its mark notwithstanding"
    return False, ""


def _contents(files: Mapping[str, dict]) -> dict[str, str]:
    return {rel: content_of(e) for rel, e in files.items()}


class Rotations:
    """Step folders a writer node removed whole: they leave the checkpoint whole (22.4).

    A node *wrote* a unit when the last commit names it a writer of one of its files (a
    restored, unchanged copy makes no writer: `merge_reports`) or a round of this job saw it
    write one (a folder rotated before any commit took it). When such a node holds none of
    the unit any more, its other nodes' files go too, and stay out while that node holds
    none of it (a new save of the same step brings it back under the normal rules). A
    writer that is not in this job (fewer nodes after a requeue) decides nothing; a failed
    round commits nothing and is never looked at. Other units keep the per-file rule."""

    def __init__(self) -> None:
        self.writers: dict[str, set[int]] = {}  # step folder -> nodes seen writing it in this job's rounds
        self.gone: dict[str, set[int]] = {}  # step folder -> the writer nodes that removed it

    def drop(self, held: Mapping[int, Iterable[str]], writers: Mapping[str, Iterable[int]],
             committed_writers: Mapping[str, Iterable[int]]) -> set[str]:
        """The step folders to leave out of this round. `held`: node index -> the files it
        holds now (every node of the round); `writers`: this round's merged writers;
        `committed_writers`: file -> writer nodes of the last commit."""
        units_held = {i: {unit_of(rel) for rel in rels} for i, rels in held.items()}
        anywhere = set().union(*units_held.values()) if units_held else set()
        wrote: dict[str, set[int]] = {}
        for source in (committed_writers, writers):
            for rel, nodes in source.items():
                unit = unit_of(rel)
                if is_step_unit(unit):
                    wrote.setdefault(unit, set()).update(nodes)
        for unit, nodes in wrote.items():
            if unit in anywhere:
                self.writers.setdefault(unit, set()).update(nodes)
        for unit in list(self.writers):
            removers = {i for i in self.writers[unit] if i in units_held and unit not in units_held[i]}
            if unit not in anywhere:  # gone from every node: nothing to leave out, nothing to remember
                self.writers.pop(unit)
                self.gone.pop(unit, None)
            elif removers:
                self.gone.setdefault(unit, set()).update(removers)
        for unit in list(self.gone):  # a remover holding it again: a new save, normal rules
            if any(unit in units_held.get(i, ()) for i in self.gone[unit]):
                self.gone.pop(unit)
        return set(self.gone)
