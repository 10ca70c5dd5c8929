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
    # dcgm-exporter's labels, so dashboards join on UUID
    assert ('slurmagent_gpu_healthy{UUID="GPU-00000003-0000-0000-0000-000000000000",gpu="3",'
            'pci_bus_id="00000000:48:00.0"} 0') in text, text
    assert ('slurmagent_gpu_healthy{UUID="GPU-00000002-0000-0000-0000-000000000000",gpu="2",'
            'pci_bus_id="00000000:38:00.0"} 1') in text
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


def test_every_value_parses_back_exactly_with_prometheus_s_parser(tmp_path):
    """`{v:g}` printed 1796130845 as 1.79613e+09 (~5000 s off: a staleness alert could not work)."""
    from prometheus_client.parser import text_string_to_metric_families

    m = Metrics(tmp_path)
    m.record_check(report(xid_snapshot_dict(79, gpu=3)), drained_rule="xid 79")
    m.update(set_={("slurmagent_last_check_timestamp_seconds", ()): 1796130845,
                   ("slurmagent_flush_seconds", ()): 12.345678912345,
                   ("slurmagent_checkpoint_lag_seconds", (("job_id", "7"),)): 0.1 + 0.2},
             add={("slurmagent_bytes_synced_total", ()): 2 ** 53 - 1, ("slurmagent_requeues_total", ()): 3})
    stored = read_values(tmp_path)
    parsed = {}
    for family in text_string_to_metric_families((tmp_path / "slurmagent.prom").read_text()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            parsed[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    assert parsed == stored  # every series, every value, bit for bit
    assert parsed["slurmagent_last_check_timestamp_seconds"] == 1796130845
    assert parsed["slurmagent_bytes_synced_total"] == 2 ** 53 - 1
    uuids = {k for k in parsed if k.startswith("slurmagent_gpu_healthy{")}
    assert len(uuids) == 8 and all('UUID="GPU-' in k and "pci_bus_id=" in k for k in uuids)


def test_an_update_that_changes_nothing_rewrites_nothing(tmp_path):
    """A gauge set to the value it has (the journal backlog 0 after every replay) costs a lock and
    a read, not two atomic rewrites on the drain path."""
    m = Metrics(tmp_path)
    m.update(set_={("slurmagent_journal_pending", ()): 0})
    prom = tmp_path / "slurmagent.prom"
    first = prom.stat().st_ino
    m.update(set_={("slurmagent_journal_pending", ()): 0})
    assert prom.stat().st_ino == first  # atomic_write_text replaces the file: a new inode
    m.update(set_={("slurmagent_journal_pending", ()): 1})
    assert prom.stat().st_ino != first and "slurmagent_journal_pending 1\n" in prom.read_text()
