"""A slow network link, live: the DP gradient all-reduce is emulated over the network (one rank per
node), one rank's link slows 4x, and the runtime finds that rank from ring probes, not from compute."""

import pytest

from steptune.resilience.live import allreduce_seconds, run_live

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def test_slow_link_detected_and_localized_without_compute_alarms():
    spec = {"steps": 16, "seed": 0, "time_scale": 0.04, "ranks_per_node": 1, "faults": [],
            "link_faults": [{"rank": 2, "factor": 4.0, "start": 11}]}  # fmt: skip
    assert allreduce_seconds(spec, 4) > 0.3  # 8B bf16 gradients over the network: about half a second
    res = run_live(spec, 4)
    rows = res["reports"]
    summary = "\n".join(str((r["step"], round(r["wall_s"], 1), r["alarms"], r["link_alarms"],
                             [round(x, 2) for x in r["comm_s"]])) for r in rows)  # fmt: skip
    links = [(r["step"], a) for r in rows for a in r["link_alarms"]]
    assert len(links) == 1, summary  # one episode, one alarm
    step, alarm = links[0]
    assert 11 <= step <= 13, summary
    assert alarm["rank"] == 2 and 2 in alarm["link"], summary  # the NIC both of its ring links share
    assert 3.0 < alarm["slowdown"] < 5.0, summary
    assert not any(r["alarms"] for r in rows), summary  # no rank's compute was blamed
    # The collective itself got slower on every rank, by about the link's factor.
    healthy = sum(r["comm_s"][0] for r in rows[6:11]) / 5
    assert all(x > 2.5 * healthy for x in rows[-1]["comm_s"]), summary
