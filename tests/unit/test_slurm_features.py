"""What the running Slurm offers (slurm/features.py): read from `scontrol show config` as 22.05,
24.11 and 26.05 print it, and the decisions taken on it."""

from __future__ import annotations

import pytest

from slurmagent.slurm.features import (
    EXPEDITE,
    SlurmFeatures,
    controller_address,
    doctor_line,
    parse_show_config,
    parse_version,
    requeue_option,
    user_chose_requeue,
)

# Slurm 26.05.5's `scontrol show config` (trimmed), with a later section that repeats a key
SHOW_CONFIG_2605 = """Configuration data as of 2026-12-02T01:46:05
AccountingStorageBackupHost = (null)
AuthInfo                = cred_expire=20,socket=/run/sa-munge-vzompw8m/munge.socket.2
CommunicationParameters = (null)
MetricsAuthUsers        = (null)
MetricsParameters       = (null)
MetricsType             = metrics/openmetrics
PrivateData             = none
SchedulerParameters     = nohold_on_prolog_fail,bf_interval=1,sched_interval=1
SlurmctldPort           = 29794
SlurmctldParameters     = enable_configless,enable_expedited_requeue
SLURM_VERSION           = 26.05.5

Cgroup Support Configuration:
MetricsType             = something/else
"""

SHOW_CONFIG_2205 = """Configuration data as of 2026-12-02T01:00:00
SlurmctldParameters     = enable_configless
SlurmctldPort           = 6817-6818
SLURM_VERSION           = 22.05.8
"""


def features(text: str) -> SlurmFeatures:
    return SlurmFeatures.from_config(parse_show_config(text))


def test_show_config_reads_keys_values_and_nulls():
    conf = parse_show_config(SHOW_CONFIG_2605)
    assert conf["SLURM_VERSION"] == "26.05.5"
    assert conf["AuthInfo"] == "cred_expire=20,socket=/run/sa-munge-vzompw8m/munge.socket.2"
    assert conf["MetricsAuthUsers"] == ""
    assert conf["MetricsType"] == "metrics/openmetrics"  # slurm.conf's, not a later section's
    assert "Configuration data as of 2026-12-02T01:46:05" not in conf


@pytest.mark.parametrize(("text", "version"), [
    ("26.05.5", (26, 5, 5)), ("25.11.0", (25, 11, 0)), ("24.11.0-0rc1", (24, 11, 0)), ("22.05", (22, 5)),
    ("", ()), ("unknown", ()),
])
def test_versions_compare_as_numbers(text, version):
    assert parse_version(text) == version


def test_slurm_26_05_with_both_on():
    f = features(SHOW_CONFIG_2605)
    assert f.version_text == "26.05.5"
    assert f.expedited_requeue and f.openmetrics and not f.metrics_need_token
    assert f.ctld_port == 29794
    assert requeue_option(f) == EXPEDITE


def test_older_slurm_never_gets_the_new_options():
    # a 22.05 controller knows neither: the parameter would be a typo there, sbatch would refuse the option
    f = features(SHOW_CONFIG_2205.replace("enable_configless", "enable_expedited_requeue")
                 + "MetricsType = metrics/openmetrics\n")
    assert not f.expedited_requeue and not f.openmetrics
    assert f.ctld_port == 6817
    assert requeue_option(f) == "--requeue"


def test_expedite_needs_the_controller_parameter():
    f = features(SHOW_CONFIG_2605.replace("enable_configless,enable_expedited_requeue", "enable_configless"))
    assert not f.expedited_requeue
    assert requeue_option(f) == "--requeue"
    assert requeue_option(None) == "--requeue"  # the config could not be read: as before 25.11


@pytest.mark.parametrize(("change", "on", "token"), [
    ({}, True, False),
    ({"MetricsType": ""}, False, False),
    ({"CommunicationParameters": "disable_http,keepaliveinterval=30"}, False, False),
    ({"PrivateData": "jobs,nodes"}, True, True),
    ({"PrivateData": "jobs", "MetricsParameters": "ignore_private_data"}, True, False),
    ({"MetricsAuthUsers": "alice", "MetricsParameters": "ignore_private_data"}, True, True),
])
def test_the_metrics_endpoint_is_on_and_open_only_as_the_config_says(change, on, token):
    conf = {**parse_show_config(SHOW_CONFIG_2605), **change}
    f = SlurmFeatures.from_config(conf)
    assert (f.openmetrics, f.metrics_need_token) == (on, token)


@pytest.mark.parametrize(("opts", "env", "chose"), [
    (["-N1", "--gres=gpu:8"], {}, False),
    (["--requeue"], {}, True),
    (["--requeue=expedite"], {}, True),
    (["--no-requeue"], {}, True),
    (["--comment=--requeue-me"], {}, False),
    ([], {"SBATCH_NO_REQUEUE": "1"}, True),
    ([], {"SBATCH_REQUEUE": "1"}, True),
])
def test_the_users_own_requeue_choice_is_seen(opts, env, chose):
    assert user_chose_requeue(opts, env) is chose


@pytest.mark.parametrize(("value", "address"), [
    ("vm(127.0.0.1)", "127.0.0.1"), ("ctl-0", "ctl-0"), ("ctl-0(10.0.0.2)", "10.0.0.2"), ("", ""),
])
def test_the_controllers_address_is_its_addr_else_its_name(value, address):
    assert controller_address({"SlurmctldHost[0]": value}) == address


def test_doctor_says_what_is_on_and_fails_only_for_a_silent_endpoint():
    url = "http://127.0.0.1:29794/metrics"
    ok, detail, skipped = doctor_line(features(SHOW_CONFIG_2605), url, None)
    assert (ok, skipped) == (True, False)
    assert detail == ("Slurm 26.05.5: expedited requeue on: slurmagent sbatch submits --requeue=expedite; "
                      f"slurmctld metrics on at {url} (scrape: contrib/prometheus/scrape.yml)")
    ok, detail, _ = doctor_line(features(SHOW_CONFIG_2605), url, "Connection refused")
    assert not ok and f"configured at {url} but it does not answer: Connection refused" in detail
    off = features(SHOW_CONFIG_2605.replace("metrics/openmetrics", "(null)").replace(",enable_expedited_requeue", ""))
    ok, detail, skipped = doctor_line(off, url, None)
    assert ok and not skipped
    assert "expedited requeue off (SlurmctldParameters=enable_expedited_requeue" in detail
    assert "slurmctld metrics off (MetricsType=metrics/openmetrics" in detail
    ok, detail, skipped = doctor_line(features(SHOW_CONFIG_2205), url, None)
    assert ok and skipped and detail.startswith("Slurm 22.05.8: none")
