"""The trainer's word (`trainer.saved`) and the frameworks' own marks as commit evidence (issue 35):
what a periodic commit takes from a folder the trainer declared, or a step folder with its mark."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmagent import trainer
from slurmagent.checkpoint.cut import QuietCut, round_views, unit_files, unit_marks
from slurmagent.checkpoint.saved import SAVED_DIR, declared_sets, read_declarations


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    d.mkdir()
    monkeypatch.setenv("SLURMAGENT_CKPT_DIR", str(d))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    trainer.reset()
    yield d
    trainer.reset()


def entry(content: str) -> dict:
    return {"size": len(content), "sha256": content}


def write(d, rel: str, content: str) -> None:
    path = d / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)


def round_of(d, before, cut: QuietCut, previous, declared=None, running=True):
    """One periodic round over `d` as the single-node store runs it (files = the disk now)."""
    after = unit_files(d)
    files = {rel: entry((d / rel).read_text()) for unit in after.values() for rel in unit}
    views = {0: round_views(before, after, (), 0, unit_marks(d, after))}
    declared = declared_sets(read_declarations(d), before, after) if declared is None else declared
    return cut.take(files, {}, {0: {}}, previous_files=previous, running=running, views=views, declared=declared)


def test_saved_records_what_the_rank_wrote_and_a_rewrite_voids_it(ckpt):
    write(ckpt, "model.pt", "m1")
    write(ckpt, "step_3/shard.bin", "s1")
    trainer.saved(["model.pt", ckpt / "step_3"], step=3)
    trainer.saved("/elsewhere/x.pt")  # outside the directory: left out, never an error
    (decl, other) = read_declarations(ckpt)
    assert (decl.rank, decl.step, sorted(decl.files)) == (0, 3, ["model.pt", "step_3/shard.bin"])
    assert other.files == {}
    now = unit_files(ckpt)
    assert ["step 3", ["model.pt", "step_3/shard.bin"], True] in declared_sets(read_declarations(ckpt), now, now)
    write(ckpt, "model.pt", "m2 longer")  # rewritten since the call
    later = unit_files(ckpt)
    assert ["step 3", ["model.pt", "step_3/shard.bin"], False] in declared_sets(read_declarations(ckpt), later, later)


def test_saved_outside_the_wrapper_and_on_a_vanished_directory_never_raises(ckpt, monkeypatch):
    monkeypatch.delenv("SLURMAGENT_CKPT_DIR")
    trainer.saved("model.pt")
    monkeypatch.setenv("SLURMAGENT_CKPT_DIR", str(ckpt / "gone" / "deeper"))
    trainer.saved("model.pt", step=1)


@pytest.mark.parametrize("body", [b"{", b"[1]", b'[{"rank": 0, "seq": 0, "step": "x", "files": {}}]',
                                  b'[{"rank": 0, "seq": 0, "step": 1, "files": {"a": [1, 2]}}]', b"\xff" * 10])
def test_a_malformed_declaration_file_is_skipped(ckpt, body):
    (ckpt / SAVED_DIR).mkdir()
    (ckpt / SAVED_DIR / "rank-0.json").write_bytes(body)
    assert read_declarations(ckpt) == []


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["rank", "seq", "step", "files", "a"]),
                                                               inner, max_size=5)).map(lambda v: json.dumps(v).encode())))
def test_any_declaration_file_reads_as_declarations_or_nothing(tmp_path_factory, body):
    d = tmp_path_factory.mktemp("fuzz")
    (d / SAVED_DIR).mkdir()
    (d / SAVED_DIR / "rank-0.json").write_bytes(body)
    got = read_declarations(d)
    assert isinstance(got, list)
    declared_sets(got, unit_files(d), unit_files(d))


def test_a_declared_pair_is_taken_at_once_and_kept_together_while_one_file_is_rewritten(ckpt):
    cut = QuietCut(settle_s=3600)  # timing alone would never take two young files
    write(ckpt, "model.pt", "model 1")
    write(ckpt, "optim.pt", "optim 1")
    write(ckpt, "train.log", "step 1\n")
    trainer.saved(["model.pt", "optim.pt"], step=1)
    first = round_of(ckpt, unit_files(ckpt), cut, None)
    assert {r: e["sha256"] for r, e in first.files.items()} == {
        "model.pt": "model 1", "optim.pt": "optim 1", "train.log": "step 1\n"}
    write(ckpt, "model.pt", "model 2")  # the next save, half-way: the optimizer is not written yet
    write(ckpt, "train.log", "step 1\nstep 2\n")
    second = round_of(ckpt, unit_files(ckpt), cut, first.files)
    assert (second.files["model.pt"]["sha256"], second.files["optim.pt"]["sha256"]) == ("model 1", "optim 1")
    assert second.files["train.log"]["sha256"] == "step 1\nstep 2\n"  # the log goes on being committed
    assert second.held_back == [""]
    write(ckpt, "optim.pt", "optim 2")
    trainer.saved(["model.pt", "optim.pt"], step=2)
    third = round_of(ckpt, unit_files(ckpt), cut, second.files)
    assert (third.files["model.pt"]["sha256"], third.files["optim.pt"]["sha256"]) == ("model 2", "optim 2")


def test_a_step_folder_waits_for_every_rank_that_wrote_it_to_declare(ckpt):
    cut = QuietCut()
    write(ckpt, "step_5/rank0.pt", "r0")
    write(ckpt, "step_5/rank1.pt", "r1")
    trainer.saved("step_5/rank0.pt", step=5)  # rank 0 said; rank 1 (same node here) has not yet
    held = round_of(ckpt, unit_files(ckpt), cut, None)
    assert held.files == {} and held.held_back == ["step_5"]
    rank1 = [{"rank": 1, "seq": 0, "step": 5, "files": {"step_5/rank1.pt": list(unit_files(ckpt)["step_5"]["step_5/rank1.pt"])}}]
    (ckpt / SAVED_DIR / "rank-1.json").write_text(json.dumps(rank1))
    taken = round_of(ckpt, unit_files(ckpt), cut, held.files)
    assert sorted(taken.files) == ["step_5/rank0.pt", "step_5/rank1.pt"]


def test_a_dcp_folder_with_its_metadata_is_taken_in_the_first_round_and_a_newer_shard_means_a_save(ckpt):
    write(ckpt, "step_10/__0_0.distcp", "shard")
    write(ckpt, "step_10/.metadata", "index")
    os.utime(ckpt / "step_10/__0_0.distcp", ns=(1, 1))
    cut = QuietCut()
    assert unit_marks(ckpt, unit_files(ckpt)) == {"step_10": "whole step_10/.metadata"}
    first = round_of(ckpt, unit_files(ckpt), cut, None, declared=[])
    assert sorted(first.files) == ["step_10/.metadata", "step_10/__0_0.distcp"]  # no whole quiet round needed
    write(ckpt, "step_10/__0_0.distcp", "shard rewritten")  # a new save into the same folder, index not yet
    assert unit_marks(ckpt, unit_files(ckpt))["step_10"].startswith("partial step_10/.metadata: step_10/__0_0.distcp")
    second = round_of(ckpt, unit_files(ckpt), cut, first.files, declared=[])
    assert second.files["step_10/__0_0.distcp"]["sha256"] == "shard"


def test_a_step_folder_without_a_mark_still_waits_a_whole_quiet_round(ckpt):
    write(ckpt, "step_1/weights.bin", "w")
    cut = QuietCut()
    assert round_of(ckpt, unit_files(ckpt), cut, None, declared=[]).files == {}
    assert sorted(round_of(ckpt, unit_files(ckpt), cut, None, declared=[]).files) == ["step_1/weights.bin"]


def test_a_safetensors_index_marks_its_folder_whole_only_with_every_shard(ckpt):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    write(ckpt, "checkpoint-7/model-00001-of-00002.safetensors", "s1")
    write(ckpt, "checkpoint-7/model.safetensors.index.json", json.dumps(index))
    marks = unit_marks(ckpt, unit_files(ckpt))
    assert marks["checkpoint-7"].startswith("partial checkpoint-7/model.safetensors.index.json: "
                                            "model-00002-of-00002.safetensors")
    write(ckpt, "checkpoint-7/model-00002-of-00002.safetensors", "s2")
    assert unit_marks(ckpt, unit_files(ckpt))["checkpoint-7"] == "whole checkpoint-7/model.safetensors.index.json"


def test_a_declared_step_folder_rotated_away_leaves_the_checkpoint(ckpt):
    cut = QuietCut()
    write(ckpt, "step_1/w.bin", "1")
    trainer.saved("step_1", step=1)
    first = round_of(ckpt, unit_files(ckpt), cut, None)
    assert sorted(first.files) == ["step_1/w.bin"]
    write(ckpt, "step_2/w.bin", "2")
    trainer.saved("step_2", step=2)
    (ckpt / "step_1" / "w.bin").unlink()  # keep-last-1: the trainer removes the older step
    (ckpt / "step_1").rmdir()
    second = round_of(ckpt, unit_files(ckpt), cut, first.files)
    assert sorted(second.files) == ["step_2/w.bin"]  # not held as a set "changed since declared"


def test_two_ranks_naming_one_folder_agree_on_the_version_one_of_them_saw_last(ckpt):
    write(ckpt, "step_4/a.pt", "a")
    write(ckpt, "step_4/b.pt", "b half")
    early = {"step_4/a.pt": unit_files(ckpt)["step_4"]["step_4/a.pt"],
             "step_4/b.pt": unit_files(ckpt)["step_4"]["step_4/b.pt"]}
    (ckpt / SAVED_DIR).mkdir()
    (ckpt / SAVED_DIR / "rank-0.json").write_text(json.dumps([{"rank": 0, "seq": 0, "step": 4, "files": early}]))
    write(ckpt, "step_4/b.pt", "b whole, longer")  # rank 1 finished its file after rank 0 named the folder
    now = unit_files(ckpt)
    assert declared_sets(read_declarations(ckpt), now, now) == [["step 4", ["step_4/a.pt", "step_4/b.pt"], False]]
    late = {rel: now["step_4"][rel] for rel in early}
    (ckpt / SAVED_DIR / "rank-1.json").write_text(json.dumps([{"rank": 1, "seq": 0, "step": 4, "files": late}]))
    assert declared_sets(read_declarations(ckpt), now, now) == [["step 4", ["step_4/a.pt", "step_4/b.pt"], True]]
