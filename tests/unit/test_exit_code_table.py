"""docs/admin/commands.md's exit-code column, read and held against the code: every code the
table documents for `doctor` and `expiry-watch` is one the command gives in the case the table
names, and the command gives no code the table leaves out."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from slurmagent.commands import expiry
from slurmagent.commands.doctor import exit_code
from slurmagent.commands.doctor_checks import Result, controller_results
from slurmagent.errors import ExpiryError
from slurmagent.gcp.compute import ComputeError
from slurmagent.slurm.commands import Slurm
from slurmagent.state.config import parse
from support.fake_systemd import fake_scontrol

COMMANDS_MD = Path(__file__).resolve().parents[2] / "docs/admin/commands.md"


def documented_codes(command: str) -> set[int]:
    """The codes in the exit-code cell of the table row whose first cell starts `slurmagent COMMAND`."""
    for line in COMMANDS_MD.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 3 and re.match(rf"`slurmagent {re.escape(command)}[ `]", cells[0]):
            return {int(m) for m in re.findall(r"(?:^|[;,:]\s*|`:\s*)(\d)\b", cells[2])}
    raise AssertionError(f"no row for {command} in {COMMANDS_MD}")


def test_doctor_gives_each_documented_code_and_no_other(tmp_path):
    ok = Result("a", True, "fine")
    down = controller_results(str(fake_scontrol(tmp_path / "scontrol", None)), 5, None)  # slurmctld stopped
    given = {
        exit_code([ok]),
        exit_code([ok, Result("b", False, "broken", "fix it")]),
        exit_code([ok, Result("config", False, "bad key", "fix", config_error=True), *down]),
        exit_code([ok, Result("b", False, "broken", "fix it"), *down]),  # 3 wins over 1
    }
    assert documented_codes("doctor") == given == {0, 1, 2, 3}


def test_expiry_watch_once_gives_each_documented_code_and_no_other(tmp_path, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # no metadata server: no notices, nothing else asked
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                 "gcp": {"project": "p", "zone": "z"}, "expiry": {"publish_run_file": False, "metadata_timeout_s": 0.5}})
    idle = Slurm(runner=lambda argv, timeout: subprocess.CompletedProcess(argv, 0, "", ""))

    def once(error: Exception) -> int:
        def reader(_cfg, _node):
            raise error
        return expiry.run_expiry_watch(cfg, "n1", once=True, slurm=idle, scheduling_reader=reader,
                                       machine_type_reader=lambda _t: "n2-standard-8")

    given = {once(ComputeError("instances.get: HTTP 503", 503)),  # passes by itself
             once(ComputeError("instances.get: HTTP 403 forbidden", 403)),  # lasting: protection off
             once(ExpiryError("instances.get: no instance 'n1' in p/z"))}
    assert documented_codes("expiry-watch") == given == {0, 1}
