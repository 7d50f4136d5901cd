"""``elastic`` across hosts (``elastic_nodes``): two host agents on loopback, each running the example
with two ranks; a rank's death and a whole host's death are survived by the rest."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from steptune.core.dist import master_store
from steptune.resilience.elastic import Elastic, launch, toy_train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "elastic_dp.py"


def _two_hosts(tmp_path, *flags):
    master = f"file:{tmp_path / 'rdzv'}"
    cmds = [
        [sys.executable, str(EXAMPLE), "--nnodes", "2", "--node-rank", str(k), "--master", master,
         "--ranks", "2", "--steps", "6", "--node-timeout", "2", *flags]
        for k in (0, 1)
    ]  # fmt: skip
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = [p.communicate(timeout=150) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def _diff(out):
    return float(re.search(r"max relative difference (\S+);", out).group(1))


def test_a_rank_lost_on_one_host_is_survived_by_both_hosts(tmp_path):
    # A rendezvous file left by an earlier job names a dead store: host 1 must wait for node 0's new one.
    (tmp_path / "rdzv").write_text("127.0.0.1:1")
    (rc0, out0, err0), (rc1, out1, err1) = _two_hosts(tmp_path, "--kill", "3:2")
    assert not (tmp_path / "rdzv").exists()  # node 0 removed its address at the end
    assert rc0 == 0 and rc1 == 0, (err0[-2000:], err1[-2000:])
    for out in (out0, out1):
        assert "rank 3 lost (SIGKILL)" in out, out
        assert "failed in step 2, resumed at step 2 with ranks [0, 1, 2]" in out, out
        assert "survivors [0, 1, 2]: 6 of 6 steps" in out, out
        assert _diff(out) <= 1e-5, out


def test_a_lost_host_is_survived_by_the_other(tmp_path):
    # Rank 2 kills its host agent in step 4: the agent's ranks die with it (PR_SET_PDEATHSIG), node 0
    # sees its beat stop and lists ranks 0 and 1.
    (rc0, out0, err0), (rc1, _, _) = _two_hosts(tmp_path, "--kill", "none", "--kill-host", "2:4")
    assert rc1 == -9
    assert rc0 == 0, err0[-2000:]
    assert "rank 2 lost (its host was lost)" in out0 and "rank 3 lost (its host was lost)" in out0, out0
    assert "failed in step 4, resumed at step 4 with ranks [0, 1]" in out0, out0
    assert "survivors [0, 1]: 6 of 6 steps" in out0 and _diff(out0) <= 1e-5, out0


def test_a_bad_master_says_what_to_pass():
    with pytest.raises(ValueError, match="HOST:PORT or file:PATH"):
        launch(toy_train, 1, 2, nnodes=2, node_rank=1, master="nohostport")
    with pytest.raises(ValueError, match="needs master"):
        launch(toy_train, 1, 2, nnodes=2)
    with pytest.raises(ValueError, match=r"node_rank must be in 0\.\.1"):
        launch(toy_train, 1, 2, nnodes=2, node_rank=2, master="127.0.0.1:1")


def test_a_hung_rank_on_another_host_is_killed_by_its_agent_and_survived(tmp_path):
    # Two agents (threads here, one rank each): rank 1, on node 1, stops (SIGSTOP) in step 2. Node 0's
    # coordinator takes it for hung once it is silent 2 s while rank 0 rejoins; node 1's agent kills it.
    import functools
    import threading

    train = functools.partial(toy_train, hangs=[[1, 2]])
    res = {}

    def agent(k):
        try:
            res[k] = launch(
                train, 1, 5, nnodes=2, node_rank=k, master=f"file:{tmp_path / 'rdzv'}", host="127.0.0.1",
                group_timeout_s=1.0, hang_timeout_s=2.0, timeout_s=90,
            )  # fmt: skip
        except Exception as err:  # reported below
            res[k] = err

    threads = [threading.Thread(target=agent, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for k in (0, 1):
        assert isinstance(res[k], dict), res
        assert res[k]["survivors"] == [0] and res[k]["lost"] == {1: -9} and 2.0 <= res[k]["hung"][1] < 10, res
    (rec,) = res[0]["recoveries"][0]
    assert (rec["failed_at_step"], rec["resume_step"], rec["members"]) == (2, 2, [0]), rec
    ref = toy_train(Elastic(master_store(), 0, [0], timeout_s=5), 5)
    assert max(abs(res[0]["results"][0][s] - ref[s]) / abs(ref[s]) for s in ref) <= 1e-5, res
