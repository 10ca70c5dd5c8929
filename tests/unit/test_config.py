"""The TOML config: defaults, clear errors naming key and file, safe permissions, %n expansion."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from slurmagent.state import config as config_mod
from slurmagent.state.config import Config, check_safe_permissions, load, parse, reference_markdown
from slurmagent.errors import ConfigError

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def no_env_config(monkeypatch, tmp_path):
    """Never read the machine's /etc file or an inherited SLURMAGENT_CONFIG."""
    monkeypatch.delenv(config_mod.ENV_VAR, raising=False)
    monkeypatch.setattr(config_mod, "DEFAULT_PATH", str(tmp_path / "etc-absent" / "config.toml"))


def write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


# --- defaults and file lookup -----------------------------------------------------------


def test_defaults_when_default_file_absent() -> None:
    cfg = load()
    assert cfg == Config()
    assert cfg.state_dir == "/var/lib/slurmagent"
    assert cfg.health.timeout_s == 15.0
    assert cfg.health.expected_gpus == 0
    assert cfg.repair.strategy == "auto"
    assert cfg.hooks.on_internal_error == "open"
    assert cfg.expiry.drain_lead_s == 1800


def test_default_file_is_read_when_present(monkeypatch, tmp_path) -> None:
    path = write(tmp_path / "etc" / "config.toml", "[health]\ntimeout_s = 3\n")
    monkeypatch.setattr(config_mod, "DEFAULT_PATH", str(path))
    cfg = load()
    assert cfg.health.timeout_s == 3.0
    assert isinstance(cfg.health.timeout_s, float)
    assert cfg.source == str(path)


def test_env_var_names_the_file(monkeypatch, tmp_path) -> None:
    path = write(tmp_path / "other.toml", 'state_dir = "/srv/sa"\n[repair]\nstrategy = "none"\n')
    monkeypatch.setenv(config_mod.ENV_VAR, str(path))
    cfg = load()
    assert cfg.state_dir == "/srv/sa"
    assert cfg.repair.strategy == "none"


def test_explicit_path_wins_over_env(monkeypatch, tmp_path) -> None:
    env_file = write(tmp_path / "env.toml", 'state_dir = "/from/env"\n')
    explicit = write(tmp_path / "explicit.toml", 'state_dir = "/from/explicit"\n')
    monkeypatch.setenv(config_mod.ENV_VAR, str(env_file))
    assert load(str(explicit)).state_dir == "/from/explicit"


def test_explicit_file_missing_is_an_error(tmp_path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as exc:
        load(str(missing))
    assert str(missing) in str(exc.value)
    assert "not found" in str(exc.value)


def test_env_file_missing_is_an_error(monkeypatch, tmp_path) -> None:
    missing = tmp_path / "from-env.toml"
    monkeypatch.setenv(config_mod.ENV_VAR, str(missing))
    with pytest.raises(ConfigError) as exc:
        load()
    assert str(missing) in str(exc.value)


def test_empty_file_gives_defaults(tmp_path) -> None:
    path = write(tmp_path / "empty.toml", "")
    cfg = load(str(path))
    assert cfg.health == Config().health
    assert cfg.state_dir == Config().state_dir


# --- errors name the key and the file ---------------------------------------------------


def load_text(tmp_path: Path, text: str) -> tuple[Path, str]:
    path = write(tmp_path / "c.toml", text)
    with pytest.raises(ConfigError) as exc:
        load(str(path))
    return path, str(exc.value)


def test_unknown_top_level_key(tmp_path) -> None:
    path, msg = load_text(tmp_path, 'statedir = "/x"\n')
    assert "statedir" in msg and str(path) in msg


def test_unknown_section(tmp_path) -> None:
    path, msg = load_text(tmp_path, "[healht]\ntimeout_s = 3\n")
    assert "healht" in msg and str(path) in msg


def test_unknown_section_key(tmp_path) -> None:
    path, msg = load_text(tmp_path, "[health]\ntimeout = 3\n")
    assert "health.timeout" in msg and str(path) in msg


def test_section_must_be_a_table(tmp_path) -> None:
    path, msg = load_text(tmp_path, "health = 3\n")
    assert "health" in msg and str(path) in msg


@pytest.mark.parametrize(
    ("text", "key", "want"),
    [
        ('[health]\ntimeout_s = "15"\n', "health.timeout_s", "number"),
        ("[health]\nsnapshot = 5\n", "health.snapshot", "string"),
        ("[health]\nexpected_gpus = 8.0\n", "health.expected_gpus", "integer"),
        ('[health]\nkernel_log_enabled = "yes"\n', "health.kernel_log_enabled", "true or false"),
        ("[hooks]\nsyslog = 1\n", "hooks.syslog", "true or false"),
        ("[checkpoint]\nmax_requeues = true\n", "checkpoint.max_requeues", "integer"),
        ("[slurm]\ntimeout_s = false\n", "slurm.timeout_s", "number"),
        ("state_dir = 7\n", "state_dir", "string"),
        ("[gcp]\nproject = [\"a\"]\n", "gcp.project", "string"),
    ],
)
def test_wrong_type_names_key_and_file(tmp_path, text: str, key: str, want: str) -> None:
    path, msg = load_text(tmp_path, text)
    assert f"'{key}'" in msg
    assert want in msg
    assert str(path) in msg


def test_bad_choice(tmp_path) -> None:
    path, msg = load_text(tmp_path, '[repair]\nstrategy = "reboot"\n')
    assert "repair.strategy" in msg
    assert "recreate" in msg and "report-faulty" in msg and "'reboot'" in msg


def test_bad_choice_hooks_policy(tmp_path) -> None:
    _, msg = load_text(tmp_path, '[hooks]\non_internal_error = "ajar"\n')
    assert "hooks.on_internal_error" in msg and "open" in msg and "closed" in msg


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[health]\ntimeout_s = -1\n", "health.timeout_s"),
        ("[health]\nexpected_gpus = -8\n", "health.expected_gpus"),
        ("[expiry]\ndrain_lead_s = -0.5\n", "expiry.drain_lead_s"),
        ("[repair]\nmax_drained_fraction = -0.1\n", "repair.max_drained_fraction"),
    ],
)
def test_negative_numbers_refused(tmp_path, text: str, key: str) -> None:
    path, msg = load_text(tmp_path, text)
    assert key in msg and "out of range" in msg and str(path) in msg


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("[health]\ntimeout_s = 0\n", "'health.timeout_s' = 0 is out of range (0.5 .. 3600)"),
        ("[health]\ntimeout_s = 1e308\n", "'health.timeout_s' = 1e+308 is out of range (0.5 .. 3600)"),
        ("[slurm]\ntimeout_s = 1e308\n", "'slurm.timeout_s' = 1e+308 is out of range (0.5 .. 3600)"),
        ("[checkpoint]\nsync_interval_s = 0\n", "'checkpoint.sync_interval_s' = 0 is out of range (0.1 .. 86400)"),
        ("[health]\nexpected_gpus = 100000000000000000000000\n",
         "'health.expected_gpus' = 100000000000000000000000 is out of range (0 .. 1024)"),
        ("[repair]\nmax_drained_fraction = 5\n", "'repair.max_drained_fraction' = 5 is out of range (0 .. 1)"),
        ("[checkpoint]\nsignal_lead_s = 70000\n", "'checkpoint.signal_lead_s' = 70000 is out of range (0 .. 65535)"),
        ("[expiry]\nmetadata_timeout_s = 0\n", "'expiry.metadata_timeout_s' = 0 is out of range (0.1 .. 600)"),
    ],
)
def test_numbers_outside_their_range_are_refused_at_load(tmp_path, text: str, shown: str) -> None:
    """A zero deadline spins and 1e308 overflows a timer (an XID-79 prolog failed open on it): refused at load."""
    path, msg = load_text(tmp_path, text)
    assert msg == f"config {path}: {shown}"


def test_range_bounds_are_allowed() -> None:
    cfg = parse({"health": {"timeout_s": 0.5, "expected_gpus": 1024}, "repair": {"max_drained_fraction": 1},
                 "checkpoint": {"sync_interval_s": 86400, "signal_lead_s": 65535}})
    assert cfg.health.timeout_s == 0.5 and cfg.health.expected_gpus == 1024
    assert cfg.repair.max_drained_fraction == 1.0 and cfg.checkpoint.signal_lead_s == 65535


def test_every_number_key_has_a_range_that_holds_its_default() -> None:
    """A new numeric key must say its bounds: the `range` column of docs/admin/configuration.md and the load check come from them."""
    for section in fields(Config):
        if section.name in ("state_dir", "source"):
            continue
        for f in fields(section.default_factory()):
            if str(f.type) not in ("int", "float"):
                continue
            low, high = f.metadata["range"]
            assert low is not None and high is not None, f"{section.name}.{f.name} has no range"
            # -1 is a key's documented "automatic" (run.hang_timeout_s: adaptive), never a wider range
            assert (0 <= low or low == -1 == f.default) and low <= f.default <= high, \
                f"{section.name}.{f.name}: default outside its range"


@pytest.mark.parametrize("value", ["nan", "inf", "-nan"])
def test_non_finite_numbers_refused(tmp_path, value: str) -> None:
    """`timeout_s = nan` would make every deadline comparison false: no deadline at all."""
    path, msg = load_text(tmp_path, f"[health]\ntimeout_s = {value}\n")
    assert "health.timeout_s" in msg and str(path) in msg


def test_zero_is_allowed(tmp_path) -> None:
    path = write(tmp_path / "z.toml", "[health]\nexpected_gpus = 0\n[expiry]\nflush_lead_s = 0\n")
    cfg = load(str(path))
    assert cfg.health.expected_gpus == 0 and cfg.expiry.flush_lead_s == 0.0


def test_invalid_toml(tmp_path) -> None:
    path, msg = load_text(tmp_path, "[health\ntimeout_s = 3\n")
    assert str(path) in msg and "TOML" in msg
    assert "\n" not in msg


def test_not_utf8(tmp_path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'state_dir = "/caf\xe9"\n')
    with pytest.raises(ConfigError) as exc:
        load(str(path))
    assert str(path) in str(exc.value)


def test_full_file_parses(tmp_path) -> None:
    text = """
state_dir = "/var/lib/sa/%n"
[health]
snapshot = "/snap/%n.json"
expected_gpus = 8
timeout_s = 5
kernel_log = "/kern/%n.log"
kernel_log_enabled = false
temperature_warn_c = 80
[hooks]
on_internal_error = "closed"
syslog = false
[slurm]
scontrol = "/opt/slurm/bin/scontrol"
[gcp]
project = "p"
zone = "us-central1-a"
compute_endpoint = "http://127.0.0.1:9"
[repair]
strategy = "report-faulty"
max_drained_fraction = 0.5
[checkpoint]
remote = "gs://b/p"
max_requeues = 5
[expiry]
termination_time = "2026-11-30T05:00:00Z"
drain_lead_s = 600
flush_lead_s = 60
"""
    cfg = load(str(write(tmp_path / "full.toml", text)))
    assert cfg.health.expected_gpus == 8
    assert cfg.health.kernel_log_enabled is False
    assert cfg.health.temperature_warn_c == 80.0
    assert cfg.hooks.on_internal_error == "closed"
    assert cfg.slurm.scontrol == "/opt/slurm/bin/scontrol"
    assert cfg.gcp.zone == "us-central1-a"
    assert cfg.repair.max_drained_fraction == 0.5
    assert cfg.checkpoint.max_requeues == 5
    assert cfg.expiry.termination_time == "2026-11-30T05:00:00Z"


# --- %n expansion -----------------------------------------------------------------------


def test_node_path_and_state_path_expand_node_name() -> None:
    cfg = parse({"state_dir": "/var/lib/sa/%n", "health": {"snapshot": "/snap/%n.json"}})
    assert cfg.state_path("gpu-7") == Path("/var/lib/sa/gpu-7")
    assert cfg.node_path(cfg.health.snapshot, "gpu-7") == "/snap/gpu-7.json"
    assert cfg.node_path("/plain/path", "gpu-7") == "/plain/path"
    assert cfg.node_path("", "gpu-7") == ""
    assert cfg.node_path("/a/%n/b/%n", "x") == "/a/x/b/x"


# --- permissions for a root hook --------------------------------------------------------


@pytest.fixture
def safe_dir(tmp_path) -> Path:
    d = tmp_path / "etc"
    d.mkdir()
    d.chmod(0o755)
    return d


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as root and chown them")
class TestPermissions:
    def test_root_0644_in_0755_dir_accepted(self, safe_dir) -> None:
        path = write(safe_dir / "config.toml", "[health]\ntimeout_s = 4\n", 0o644)
        check_safe_permissions(path)
        assert load(str(path), for_root_hook=True).health.timeout_s == 4.0

    @pytest.mark.parametrize("mode", [0o666, 0o664, 0o646])
    def test_writable_file_refused(self, safe_dir, mode: int) -> None:
        path = write(safe_dir / "config.toml", "", mode)
        with pytest.raises(ConfigError) as exc:
            check_safe_permissions(path)
        assert str(path) in str(exc.value) and "refused" in str(exc.value)

    def test_writable_file_refused_by_load_for_root_hook_only(self, safe_dir) -> None:
        path = write(safe_dir / "config.toml", "[health]\ntimeout_s = 4\n", 0o666)
        assert load(str(path)).health.timeout_s == 4.0  # a user's own `check` may read it
        with pytest.raises(ConfigError):
            load(str(path), for_root_hook=True)

    def test_world_writable_dir_refused(self, safe_dir) -> None:
        sub = safe_dir / "open"
        sub.mkdir()
        sub.chmod(0o777)
        path = write(sub / "config.toml", "", 0o644)
        with pytest.raises(ConfigError) as exc:
            check_safe_permissions(path)
        assert str(sub) in str(exc.value)

    def test_sticky_world_writable_dir_accepted(self, safe_dir) -> None:
        sub = safe_dir / "sticky"
        sub.mkdir()
        sub.chmod(0o1777)
        path = write(sub / "config.toml", "", 0o644)
        check_safe_permissions(path)

    def test_file_owned_by_non_root_refused(self, safe_dir) -> None:
        path = write(safe_dir / "config.toml", "", 0o644)
        os.chown(path, 65534, 65534)
        with pytest.raises(ConfigError) as exc:
            check_safe_permissions(path)
        assert "65534" in str(exc.value)

    def test_dir_owned_by_non_root_refused(self, safe_dir) -> None:
        sub = safe_dir / "user"
        sub.mkdir()
        sub.chmod(0o755)
        path = write(sub / "config.toml", "", 0o644)
        os.chown(sub, 65534, 65534)
        with pytest.raises(ConfigError):
            check_safe_permissions(path)

    def test_symlink_to_unsafe_target_refused(self, safe_dir) -> None:
        sub = safe_dir / "open"
        sub.mkdir()
        sub.chmod(0o777)
        target = write(sub / "real.toml", "", 0o644)
        link = safe_dir / "config.toml"
        link.symlink_to(target)
        with pytest.raises(ConfigError):
            check_safe_permissions(link)


# --- the generated reference ------------------------------------------------------------


def test_reference_lists_every_key() -> None:
    md = reference_markdown()
    expected = ["state_dir"]
    for f in fields(Config):
        if f.name in ("state_dir", "source"):
            continue
        expected += [f"{f.name}.{sf.name}" for sf in fields(f.default_factory())]
    listed = [line.split("|")[1].strip().strip("`") for line in md.splitlines()[2:]]
    assert listed == expected
    assert "source" not in listed


def test_reference_shows_defaults_as_toml() -> None:
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip().strip("`")
            for line in reference_markdown().splitlines()[2:]}
    assert rows["health.timeout_s"] == "15.0"
    assert rows["hooks.syslog"] == "true"
    assert rows["repair.strategy"] == '"auto"'
    assert rows["gcp.zones"] == "[]"
    assert rows["state_dir"] == '"/var/lib/slurmagent"'


def test_every_documented_key_parses_with_its_default() -> None:
    """The reference's defaults are valid values: writing them back out gives the defaults."""
    data: dict = {"state_dir": Config().state_dir}
    for f in fields(Config):
        if f.name in ("state_dir", "source"):
            continue
        section = f.default_factory()
        data[f.name] = {sf.name: getattr(section, sf.name) for sf in fields(section)}
    cfg = parse(data, "x")
    assert cfg.health == Config().health and cfg.expiry == Config().expiry and cfg.hooks == Config().hooks


# --- through the CLI --------------------------------------------------------------------


def run_cli(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != config_mod.ENV_VAR}
    env.update(env_extra or {})
    return subprocess.run([str(VENV_BIN / "slurmagent"), *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[health]\ntimeout_s = "soon"\n', "health.timeout_s"),
        ("[health]\nbogus = 1\n", "health.bogus"),
        ('[repair]\nstrategy = "pray"\n', "repair.strategy"),
        ("[health]\ntimeout_s = 1e308\n", "health.timeout_s"),
        ("[health]\nexpected_gpus = 100000000000000000000000\n", "health.expected_gpus"),
    ],
)
def test_cli_bad_config_exits_2_with_one_line(tmp_path, text: str, key: str) -> None:
    from support import healthy_snapshot_dict, write_json

    bad = write(tmp_path / "bad.toml", text)
    snap = write_json(tmp_path / "snap.json", healthy_snapshot_dict())
    proc = run_cli("--config", str(bad), "check", "--snapshot", str(snap))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert key in lines[0] and str(bad) in lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_cli_missing_env_config_exits_2(tmp_path) -> None:
    missing = tmp_path / "missing.toml"
    proc = run_cli("check", "--snapshot", str(tmp_path / "s.json"), env_extra={config_mod.ENV_VAR: str(missing)})
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and str(missing) in proc.stderr


def test_list_keys_take_lists_of_strings_only(tmp_path) -> None:
    cfg = parse({"gcp": {"zones": ["us-central1-a", "us-central1-b"]}, "repair": {"exclude_nodes": ["n[1-2]"]}})
    assert cfg.gcp.zones == ("us-central1-a", "us-central1-b") and cfg.repair.exclude_nodes == ("n[1-2]",)
    assert Config().gcp.zones == () and Config().repair.exclude_nodes == ()
    for bad in ("us-central1-a", ["a", 1]):
        with pytest.raises(ConfigError, match="'gcp.zones' must be a list of strings"):
            parse({"gcp": {"zones": bad}})
    for strategy in ("auto", "recreate", "report-faulty", "power-down", "none"):
        assert parse({"repair": {"strategy": strategy}}).repair.strategy == strategy


def test_adopt_reasons_are_regexes_checked_at_load():
    cfg = parse({"repair": {"adopt_reasons": ["^Prolog error", "Instance (stopped|deleted)"]}})
    assert cfg.repair.adopt_reasons == ("^Prolog error", "Instance (stopped|deleted)")
    assert Config().repair.adopt_reasons == ()
    with pytest.raises(ConfigError) as err:
        parse({"repair": {"adopt_reasons": ["GPU (unhealthy"]}}, source="/etc/slurmagent/config.toml")
    assert str(err.value) == ("config /etc/slurmagent/config.toml: 'repair.adopt_reasons' entry 'GPU (unhealthy' is "
                              "not a valid regular expression: missing ), unterminated subpattern at position 4")


def test_a_bad_adopt_reason_is_exit_2_with_one_line(tmp_path):
    from support import REPO

    cfg = tmp_path / "config.toml"
    cfg.write_text('[repair]\nadopt_reasons = ["[unclosed"]\n')
    out = subprocess.run([sys.executable, "-m", "slurmagent.entry", "--config", str(cfg), "repair", "--dry-run"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"slurmagent: config {cfg}: 'repair.adopt_reasons' entry '[unclosed' is not a valid regular expression: "
        "unterminated character set at position 0"]
