"""`slurmagent doctor` without a fake server: one table of ok/FAIL/skip lines, each failure
with its fix, exit 1 on any failure.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_doctor_gcp.py.

Timing (parallel lanes): nothing here is in the serial group; the bounded checks get a 2 s
deadline (the quick ones answer within it on a loaded machine) and the bound is far below the
stuck check's 60 s.
"""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time
import urllib.request

import pytest


def test_external_checks_are_bounded_even_when_one_never_returns():
    from slurmagent.commands.doctor import Result, run_bounded

    start = time.monotonic()
    rows = run_bounded([("fast", "fix-a", lambda: Result("fast", True, "fine")),
                        ("stuck", "fix-b", lambda: time.sleep(60)),
                        ("broken", "fix-c", lambda: 1 / 0)], deadline_s=2)
    # ended at the deadline, give or take a loaded machine, and long before the stuck check
    assert time.monotonic() - start < 2 + 10 < 60 / 2
    assert [(r.name, r.ok, r.detail, r.fix) for r in rows] == [
        ("fast", True, "fine", ""), ("stuck", False, "no answer within 2 s", "fix-b"),
        ("broken", False, "ZeroDivisionError: division by zero", "fix-c")]



def test_a_hung_check_of_this_host_is_a_problem_a_hung_service_is_an_outage():
    """Exit 3 says "a service did not answer, the verdict is incomplete"; systemctl or the job
    channel hanging on this host is this host's problem: exit 1."""
    from slurmagent.commands.doctor import Result, exit_code, run_bounded

    ok = ("fast", "fix-a", lambda: Result("fast", True, "fine"))
    local = run_bounded([ok, ("slurmagent-watch", "fix-b", lambda: time.sleep(60))], deadline_s=0.5)
    remote = run_bounded([ok, ("metadata server", "fix-c", lambda: time.sleep(60))], deadline_s=0.5)
    assert [r.detail for r in local + remote] == ["fine", "no answer within 0.5 s"] * 2
    assert (exit_code(local), exit_code(remote)) == (1, 3)


# --- Prolog / Epilog / HealthCheckProgram: judged from the files they run ------------------

TOOLKIT_PROLOG_D = "/slurm/custom_scripts/prolog.d"  # slurm-gcp v6: Prolog=/slurm/custom_scripts/prolog.d/*
TOOLKIT_EPILOG_D = "/slurm/custom_scripts/epilog.d"
CHS = "#!/bin/bash\n# the Toolkit's GPU health check\ndcgmi diag -r 1 || exit 1\n"


def fake_binary(tmp_path):
    binary = tmp_path / "venv/bin/slurmagent"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    return binary


def toolkit_node(tmp_path, conf_extra: str = "", install_ours: bool = True):
    """A staging root laid out as a Cluster Toolkit node: the Toolkit's own prolog, ours beside it."""
    from slurmagent.commands.install import install

    root = tmp_path / "root"
    binary = fake_binary(tmp_path)
    if install_ours:
        install(root, binary=str(binary), prolog_dir=TOOLKIT_PROLOG_D, epilog_dir=TOOLKIT_EPILOG_D)
    chs = root / TOOLKIT_PROLOG_D.lstrip("/") / "a_chs_gpu_health_check.sh"
    chs.parent.mkdir(parents=True, exist_ok=True)
    chs.write_text(CHS)
    chs.chmod(0o755)
    conf = root / "etc/slurm/slurm.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(f"Prolog={root}{TOOLKIT_PROLOG_D}/*\nEpilog={root}{TOOLKIT_EPILOG_D}/*\nPrologFlags=Alloc\n"
                    f"{conf_extra}")
    return root, conf, binary


def rows(conf):
    from slurmagent.commands.doctor import slurm_conf_results

    return {r.name: r for r in slurm_conf_results(conf)}


def test_a_toolkit_glob_passes_when_it_runs_our_shim_among_others(tmp_path):
    root, conf, binary = toolkit_node(tmp_path)
    got = rows(conf)
    prolog, epilog = got["slurm.conf Prolog"], got["slurm.conf Epilog"]
    assert prolog.mark == "ok", prolog
    assert f"{root}{TOOLKIT_PROLOG_D}/* -> 2 script(s), ours {root}{TOOLKIT_PROLOG_D}/zz-slurmagent" in prolog.detail
    assert f"(runs {binary} prolog)" in prolog.detail
    assert epilog.mark == "ok" and epilog.detail.endswith(f"(runs {binary} epilog)"), epilog
    health = got["slurm.conf HealthCheckProgram"]
    assert health.mark == "skip" and health.detail.startswith("not set"), health


def test_a_glob_without_our_shim_fails_with_the_install_command(tmp_path):
    root, conf, _ = toolkit_node(tmp_path, install_ours=False)
    prolog = rows(conf)["slurm.conf Prolog"]
    assert prolog.mark == "FAIL"
    assert prolog.detail == f"{root}{TOOLKIT_PROLOG_D}/*: no program there is slurmagent's prolog shim"
    assert "slurmagent install --prolog-dir DIR" in prolog.fix
    assert rows(conf)["slurm.conf Epilog"].detail == f"{root}{TOOLKIT_EPILOG_D}/* matches no file"


def test_the_word_slurmagent_in_the_value_is_not_enough(tmp_path):
    fake = tmp_path / "opt/slurmagent/prolog"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"Prolog={fake}\n")
    assert rows(conf)["slurm.conf Prolog"].mark == "FAIL"


def test_a_shim_whose_slurmagent_is_gone_fails_it_would_pass_every_node_unchecked(tmp_path):
    root, conf, binary = toolkit_node(tmp_path)
    binary.unlink()
    prolog = rows(conf)["slurm.conf Prolog"]
    assert prolog.mark == "FAIL"
    assert f"runs {binary}, which is missing: the node is not checked" in prolog.detail


def test_a_directory_value_fails_with_the_glob_to_use(tmp_path):
    root, conf, _ = toolkit_node(tmp_path)
    conf.write_text(f"Prolog={root}{TOOLKIT_PROLOG_D}/\nEpilog={root}{TOOLKIT_EPILOG_D}/*\n")
    prolog = rows(conf)["slurm.conf Prolog"]
    assert prolog.mark == "FAIL" and "is a directory" in prolog.detail
    assert prolog.fix == f"Prolog={root}{TOOLKIT_PROLOG_D}/*"


def test_epilog_pointing_at_the_prolog_shim_fails(tmp_path):
    root, conf, _ = toolkit_node(tmp_path)
    conf.write_text(f"Prolog={root}{TOOLKIT_PROLOG_D}/*\nEpilog={root}{TOOLKIT_PROLOG_D}/zz-slurmagent\n")
    epilog = rows(conf)["slurm.conf Epilog"]
    assert epilog.mark == "FAIL" and "is slurmagent's prolog shim, not its epilog" in epilog.detail


def test_a_relative_glob_is_read_beside_slurm_conf_and_several_prolog_lines_count(tmp_path):
    """Slurm 24.11: a relative path is beside slurm.conf (configless ships it); Prolog= may repeat."""
    root, conf, binary = toolkit_node(tmp_path)
    (conf.parent / "prolog.d").symlink_to(root / TOOLKIT_PROLOG_D.lstrip("/"))
    conf.write_text(f"Prolog=/usr/local/bin/site-prolog\nProlog=prolog.d/*\nEpilog={root}{TOOLKIT_EPILOG_D}/*\n")
    prolog = rows(conf)["slurm.conf Prolog"]
    assert prolog.mark == "ok", prolog
    assert prolog.detail.startswith("prolog.d/* -> 2 script(s), ours ")


def test_health_check_program_is_checked_when_set(tmp_path):
    root, conf, binary = toolkit_node(tmp_path)
    base = conf.read_text()
    conf.write_text(base + "HealthCheckProgram=/etc/slurmagent/hooks/healthcheck\n")
    assert rows(conf)["slurm.conf HealthCheckProgram"].mark == "FAIL"  # not in this staging root
    conf.write_text(base + f"HealthCheckProgram={root}/etc/slurmagent/hooks/healthcheck\n")
    health = rows(conf)["slurm.conf HealthCheckProgram"]
    assert health.mark == "ok" and health.detail.endswith(f"(runs {binary} healthcheck)"), health
    nhc = tmp_path / "nhc"
    nhc.write_text("#!/bin/sh\nexit 0\n")
    nhc.chmod(0o755)
    conf.write_text(base + f"HealthCheckProgram={nhc}\n")
    health = rows(conf)["slurm.conf HealthCheckProgram"]
    assert health.mark == "skip" and "is not slurmagent's" in health.detail


# --- what an admin must see running (commands/doctor_checks.py) -------------------------------


def test_a_controller_that_does_not_answer_is_exit_3_naming_it(tmp_path):
    from slurmagent.commands.doctor import exit_code
    from slurmagent.commands.doctor_checks import controller_results
    from support.fake_systemd import SHOW_CONFIG_2411, fake_scontrol

    down = controller_results(str(fake_scontrol(tmp_path / "down" / "scontrol", None)), 5, None)
    assert [(r.name, r.mark) for r in down] == [("slurm controller", "FAIL"), ("slurm 25.11+ features", "skip")]
    assert "Unable to contact slurm controller" in down[0].detail and "slurmctld" in down[0].fix
    assert exit_code(down) == 3
    up = controller_results(str(fake_scontrol(tmp_path / "up" / "scontrol", SHOW_CONFIG_2411)), 5, None)
    assert [(r.name, r.mark) for r in up] == [("slurm controller", "ok"), ("slurm 25.11+ features", "skip")]
    assert "Slurm 24.11.1" in up[0].detail and exit_code(up) == 0
    missing = controller_results(str(tmp_path / "no-scontrol"), 5, None)
    assert missing[0].mark == "FAIL" and not missing[0].unreachable and exit_code(missing) == 1


def test_the_units_states_are_reported_through_systemctl(tmp_path):
    from slurmagent.commands.doctor_checks import unit_results
    from support.fake_systemd import FakeSystemd

    fake = FakeSystemd(tmp_path / "bin")
    exe = str(fake.dir / "systemctl")

    def rows():
        return {r.name: (r.mark, r.detail, r.fix) for r in unit_results(exe)}

    assert {n: m for n, (m, _, _) in rows().items()} == {"slurmagent-watch": "ok", "expiry timer": "ok"}
    assert "last run ok" in rows()["expiry timer"][1]
    fake.update("slurmagent-watch.service", ActiveState="failed", SubState="failed")
    fake.update("slurmagent-expiry.service", Result="exit-code", ExecMainStatus="1")
    r = rows()
    assert r["slurmagent-watch"][0] == "FAIL" and "failed" in r["slurmagent-watch"][1]
    assert "systemctl enable --now slurmagent-watch" in r["slurmagent-watch"][2]
    assert r["expiry timer"][0] == "FAIL" and "last run failed (exit-code, exit 1)" in r["expiry timer"][1]
    assert "compute_api = false" in r["expiry timer"][2]
    fake.update("slurmagent-watch.service", UnitFileState="disabled")
    fake.update("slurmagent-expiry.timer", UnitFileState="disabled", ActiveState="inactive")
    r = rows()
    assert "will not start at boot" in r["slurmagent-watch"][1]
    assert r["expiry timer"][0] == "FAIL" and "nothing drains or flushes" in r["expiry timer"][1]
    fake.remove("slurmagent-watch.service")
    assert rows()["slurmagent-watch"][:2] == ("FAIL", "slurmagent-watch.service is not installed")
    fake.down()  # a container: systemd does not run, nothing to judge
    assert {n: m for n, (m, _, _) in rows().items()} == {"slurmagent-watch": "skip", "expiry timer": "skip"}


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, never listening: refused at once
    url = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
    s.close()
    return url


def test_the_metrics_file_must_be_readable_by_node_exporter(tmp_path):
    from slurmagent.commands.doctor_checks import metrics_file_result

    none = _closed_port_url()
    d = tmp_path / "state"
    assert metrics_file_result(d / "slurmagent.prom", none).mark == "skip"  # not written yet
    d.mkdir(mode=0o700)
    d.chmod(0o700)
    r = metrics_file_result(d / "slurmagent.prom", none)
    assert r.mark == "FAIL" and "cannot list" in r.detail and f"chmod o+rx {d}" in r.fix
    d.chmod(0o755)
    (d / "slurmagent.prom").write_text("x 1\n")
    (d / "slurmagent.prom").chmod(0o600)
    assert metrics_file_result(d / "slurmagent.prom", none).mark == "FAIL"
    (d / "slurmagent.prom").chmod(0o644)
    r = metrics_file_result(d / "slurmagent.prom", none)
    assert r.mark == "ok" and "no node_exporter answers" in r.detail
    if os.geteuid() == 0:  # root writes only into a directory only root can write: said as the writer refuses it
        d.chmod(0o775)
        r = metrics_file_result(d / "slurmagent.prom", none)
        assert r.mark == "FAIL" and f"root writes no metrics into {d}: writable by non-root users" in r.detail, r


@pytest.mark.parametrize("exposition, mark, words", [
    ('node_textfile_scrape_error 0\nnode_textfile_mtime_seconds{file="{f}"} 1.7e9\n', "ok", "reads"),
    ('node_textfile_scrape_error 1\nnode_textfile_mtime_seconds{file="{f}"} 1.7e9\n', "FAIL", "scrape_error 1"),
    ('node_textfile_scrape_error 0\nnode_textfile_mtime_seconds{file="/other/x.prom"} 1.7e9\n', "FAIL",
     "does not read"),
    ("node_cpu_seconds_total 1\n", "FAIL", "no textfile collector"),
])
def test_node_exporter_says_whether_it_reads_the_file(tmp_path, monkeypatch, exposition, mark, words):
    """Where node_exporter answers on this host, its own metrics judge the file (a fake exporter
    here), asked directly: root's `http_proxy` (here a closed port) is not in the way."""
    from slurmagent.commands.doctor_checks import metrics_file_result

    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's own opener read the environment once

    d = tmp_path / "state"
    d.mkdir()
    d.chmod(0o755)
    (d / "slurmagent.prom").write_text("x 1\n")
    (d / "slurmagent.prom").chmod(0o644)
    body = exposition.replace("{f}", str(d / "slurmagent.prom")).encode()

    class Exporter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Exporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = metrics_file_result(d / "slurmagent.prom", f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    assert r.mark == mark and words in r.detail, r


def test_slurm_conf_is_found_as_the_hooks_find_it_configless_cache_included(tmp_path):
    """A configless node: no /etc/slurm/slurm.conf, no [slurm] conf; the cache slurmd keeps is read."""
    from slurmagent.commands.doctor import install_still_needs, slurm_conf_results
    from slurmagent.commands.doctor_checks import find_slurm_conf

    search = (tmp_path / "run/slurm/conf/slurm.conf", tmp_path / "var/spool/slurmd/conf-cache/slurm.conf",
              tmp_path / "etc/slurm/slurm.conf")
    assert find_slurm_conf("", {}, search) == (None, list(search))
    assert slurm_conf_results(None, list(search))[0].detail.startswith(f"cannot read a slurm.conf (tried {search[0]}")
    search[1].parent.mkdir(parents=True)
    search[1].write_text("PrologFlags=Alloc\n")
    assert find_slurm_conf("", {}, search)[0] == search[1]
    assert find_slurm_conf("", {"SLURM_CONF": str(tmp_path / "gone")}, search)[0] == search[1]
    where, missing = install_still_needs(tmp_path)  # install --root: the same search under the root
    assert where == str(search[1]) and not any("PrologFlags" in m for m in missing)
    assert any(m.startswith("slurm.conf nohold_on_prolog_fail") for m in missing)


def test_a_configured_slurm_conf_that_cannot_be_read_is_said_not_passed_over(tmp_path, monkeypatch):
    """`[slurm] conf` names a file that is not there (a typo, a Toolkit path of another version):
    doctor says so in its own line, even when the search finds another slurm.conf to judge."""
    from slurmagent.commands import doctor, health

    other = tmp_path / "etc" / "slurm.conf"
    other.parent.mkdir()
    other.write_text("Prolog=/x\n")
    monkeypatch.setattr(health, "SOURCES", health.CountSources(conf_search=(other,), env={}))
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    cfg = tmp_path / "slurmagent.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[slurm]\nconf = "{tmp_path}/typo/slurm.conf"\n')
    rows = {r.name: r for r in doctor.run_doctor(str(cfg), external_deadline_s=1)}
    row = rows["[slurm] conf"]
    assert not row.ok and row.detail == f"{tmp_path}/typo/slurm.conf is not a readable file; read {other} instead"
    assert doctor.exit_code(list(rows.values())) != 0
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[slurm]\nconf = "{other}"\n')
    assert "[slurm] conf" not in {r.name for r in doctor.run_doctor(str(cfg), external_deadline_s=1)}
