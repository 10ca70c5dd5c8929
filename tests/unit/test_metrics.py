"""Prometheus textfile output: gauges from a report, counters shared across processes."""

from __future__ import annotations

import multiprocessing

from support import xid_snapshot_dict, healthy_snapshot_dict
from slurmagent.core.checks import run_checks
from slurmagent.state.metrics import Metrics, read_values
from slurmagent.core.snapshot import NodeSnapshot


def report(d):
    return run_checks(NodeSnapshot.from_dict(d), expected_gpus=8)


def test_textfile_has_gpu_gauges_and_drain_counter(tmp_path):
    m = Metrics(tmp_path)
    m.record_check(report(healthy_snapshot_dict()))
    m.record_check(report(xid_snapshot_dict(79, gpu=3)), drained_rule="xid")
    text = (tmp_path / "slurmagent.prom").read_text()
    assert '# TYPE slurmagent_gpu_healthy gauge' in text
    assert 'slurmagent_gpu_healthy{gpu="3"} 0' in text and 'slurmagent_gpu_healthy{gpu="2"} 1' in text
    assert "slurmagent_node_healthy 0" in text
    assert 'slurmagent_drains_total{rule="xid"} 1' in text
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, no leftovers


def _bump(state_dir):
    Metrics(state_dir).update(add={("slurmagent_requeues_total", ()): 1})


def test_counters_add_up_across_processes(tmp_path):
    procs = [multiprocessing.Process(target=_bump, args=(tmp_path,)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert read_values(tmp_path)["slurmagent_requeues_total"] == 8.0


def test_unwritable_metrics_never_raise(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    Metrics(blocker / "sub").update(add={("slurmagent_repairs_total", ()): 1})
    assert "cannot write metrics" in capsys.readouterr().err
