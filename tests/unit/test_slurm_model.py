"""The node/job model parsed from `scontrol -o`: one parser, pure predicates.

There were two parsers (slurm.node_from_kv and policy.node_view); their readings of the
`[user@time]` stamp that scontrol appends to a node's Reason were pinned here before the merge
(commit "test_nodes: pin today's two reason-stamp rules"). The merged rule strips every
`[user@time]` suffix as node_from_kv did (so `[admin@Unknown]` no longer makes an equal reason
look different) and keeps the stamp's time when it is one, as node_view did."""

from __future__ import annotations

import pytest

from slurmagent.slurm.model import node_from_kv, parse_kv

STAMPS = [
    # (Reason field as scontrol prints it, reason today by node_from_kv, by node_view, stamp parsed)
    ("slurmagent: xid 79 on gpu 3 [root@2026-11-30T09:49:04]", "slurmagent: xid 79 on gpu 3",
     "slurmagent: xid 79 on gpu 3", True),
    ("maintenance [admin@Unknown]", "maintenance", "maintenance [admin@Unknown]", False),
    ("odd [a@b@c]", "odd", "odd [a@b@c]", False),
    ("no stamp at all", "no stamp at all", "no stamp at all", False),
    ("(null)", "", "", False),
]


@pytest.mark.parametrize("field,by_info,by_view,stamped", STAMPS)
def test_one_reason_stamp_rule(field, by_info, by_view, stamped):
    node = node_from_kv(parse_kv(f"NodeName=n1 State=IDLE+DRAIN Reason={field}"))
    assert node.reason == by_info  # stripped as node_from_kv did
    assert (node.reason_time is not None) == stamped  # timed as node_view did
