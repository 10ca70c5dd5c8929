"""The node/job model parsed from `scontrol -o`: one parser, pure predicates.

Pinned first: how the two parsers of today (slurm.node_from_kv and policy.node_view) read the
`[user@time]` stamp that scontrol appends to a node's Reason."""

from __future__ import annotations

import pytest

from slurmagent import policy
from slurmagent.slurm import node_from_kv, parse_kv

STAMPS = [
    # (Reason field as scontrol prints it, reason by node_from_kv, reason by node_view, stamp parsed)
    ("slurmagent: xid 79 on gpu 3 [root@2026-11-30T09:49:04]", "slurmagent: xid 79 on gpu 3",
     "slurmagent: xid 79 on gpu 3", True),
    ("maintenance [admin@Unknown]", "maintenance", "maintenance [admin@Unknown]", False),
    ("odd [a@b@c]", "odd", "odd [a@b@c]", False),
    ("no stamp at all", "no stamp at all", "no stamp at all", False),
    ("(null)", "", "", False),
]


@pytest.mark.parametrize("field,by_info,by_view,stamped", STAMPS)
def test_todays_two_reason_stamp_rules(field, by_info, by_view, stamped):
    kv = parse_kv(f"NodeName=n1 State=IDLE+DRAIN Reason={field}")
    assert node_from_kv(kv).reason == by_info
    view = policy.node_view(kv)
    assert view.reason == by_view
    assert (view.reason_time is not None) == stamped
