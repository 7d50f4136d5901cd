"""``elastic`` across two hosts, with faults made from outside the job while it runs: a network
partition between two hosts that are really apart, healed late or early, and a host agent that stalls
(SIGSTOP) while its ranks run on.

The partitions run in two network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2, no loopback
between them), one agent in each; a ``blackhole`` qdisc on both ends makes packets vanish silently, as
when a switch port dies. Node 1 finds its own address from the route to node 0. They need root (``ip
netns``) and are skipped otherwise; the stalled agent runs on loopback anywhere."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from steptune.core.dist import master_store
from steptune.resilience.elastic import Elastic, toy_train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

AGENT = Path(__file__).with_name("two_hosts_agent.py")
SRC = Path(__file__).resolve().parents[3] / "src"
STEPS = 24


def _ip(*args, ns=None, check=True):
    cmd = [*(["ip", "netns", "exec", ns] if ns else []), "ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def netns():
    """Two namespaces, node 0's (10.77.0.1) and node 1's (10.77.0.2): ``{"prefixes": the commands that run
    a program in each, "hosts": the agents' host arguments, "cut": cut(on) partitions or heals the link}``."""
    if sys.platform != "linux" or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs Linux with iproute2 (ip, tc)")
    a, b = f"st{os.getpid()}a", f"st{os.getpid()}b"
    made = []
    try:
        for ns in (a, b):
            if _ip("netns", "add", ns, check=False).returncode != 0:
                pytest.skip("cannot create network namespaces here (needs root / CAP_NET_ADMIN)")
            made.append(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", f"{a}v", "netns", a, "type", "veth", "peer", "name", f"{b}v", "netns", b)
        for ns, addr in ((a, "10.77.0.1/24"), (b, "10.77.0.2/24")):
            _ip("addr", "add", addr, "dev", f"{ns}v", ns=ns)
            _ip("link", "set", f"{ns}v", "up", ns=ns)

        def cut(on: bool) -> None:
            for ns in (a, b):
                tc = ["tc", "qdisc", "add" if on else "del", "dev", f"{ns}v", "root"]
                tc += ["blackhole"] if on else []
                res = subprocess.run(
                    ["ip", "netns", "exec", ns, *tc], capture_output=True, text=True, timeout=30
                )
                if res.returncode != 0:
                    pytest.skip(f"tc cannot {'add' if on else 'remove'} a blackhole qdisc here: {res.stderr}")

        prefixes = [["ip", "netns", "exec", ns] for ns in (a, b)]
        yield {"prefixes": prefixes, "hosts": ["10.77.0.1", "auto"], "cut": cut}
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)


def _reference():
    """The failure-free trajectory: the same loop on one rank, in this process."""
    return toy_train(Elastic(master_store(), 0, [0], timeout_s=5), STEPS)


def _run(tmp_path, prefixes, hosts, fault):
    """Both agents; ``fault(procs)`` runs once rank 0 reaches step 3. Returns each node's (exit code, JSON
    line, stderr)."""
    mark, master = tmp_path / "mark", f"file:{tmp_path / 'rdzv'}"
    path = f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    args = [str(STEPS), str(mark)]
    cmds = [[*prefixes[k], sys.executable, str(AGENT), str(k), master, hosts[k], *args] for k in (0, 1)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    procs = [subprocess.Popen(c, **pipes) for c in cmds]
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate(timeout=30)
            time.sleep(0.02)
        fault(procs)
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)  # a stopped agent: let it run its cleanup after the kill
                p.kill()
    return [
        (p.returncode, json.loads(out.strip().splitlines()[-1]), err)
        for p, (out, err) in zip(procs, outs, strict=True)
    ]


def _is_resource_tracker(proc):
    """The spawn context's helper process, which an agent has beside its ranks."""
    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:  # a zombie: not the tracker, which lives as long as its agent
        return False


def _check_survivors(res0, ref):
    """Node 0 went on with ranks 0 and 1 alone, after one regrouping, on the failure-free losses."""
    assert res0["survivors"] == [0, 1] and res0["lost"] == {"2": None, "3": None}, res0
    losses = {int(k): v for k, v in res0["losses"].items()}
    assert sorted(losses) == list(range(STEPS)), res0
    assert max(abs(losses[k] - ref[k]) / abs(ref[k]) for k in ref) <= 1e-5, (losses, ref)
    assert [r["members"] for r in res0["recoveries"]] == [[0, 1]], res0


def test_a_partition_that_never_heals_loses_the_cut_off_host_and_stops_it(netns, tmp_path):
    # Node 0 hears no beat for 2 s, fences node 1 and lists ranks 0 and 1; their all-reduce with the cut-off
    # ranks times out (8 s) and they redo the step alone. Node 1's store calls get no answer (a TCPStore
    # client would wait for one for ~15 minutes): after 10 s its agent stops its ranks and says why, while
    # the link is still cut.
    def cut_until_both_end(procs):
        netns["cut"](True)
        procs[1].wait(timeout=90)
        procs[0].wait(timeout=150)
        netns["cut"](False)

    ref = _reference()
    (rc0, res0, err0), (rc1, res1, err1) = _run(
        tmp_path, netns["prefixes"], netns["hosts"], cut_until_both_end
    )
    assert rc0 == 0, err0[-3000:]
    _check_survivors(res0, ref)
    assert rc1 == 1 and "node 1 got no answer from the store at 10.77.0.1:" in res1["error"], (
        res1,
        err1[-3000:],
    )
    assert res1["after_s"] < 60, res1


def test_a_partition_healed_after_the_host_was_fenced_stops_its_ranks(netns, tmp_path):
    # Healed after 4 s: past the 2 s node timeout, before the 8 s group timeout. The all-reduce stuck
    # across the cut completes once TCP resends (then every rank goes on for a moment) or times out; either
    # way node 1's ranks and agent read the fence and stop, and the survivors rejoin and redo their step.
    def cut_for_4_s(procs):
        netns["cut"](True)
        time.sleep(4.0)
        netns["cut"](False)

    ref = _reference()
    (rc0, res0, err0), (rc1, res1, err1) = _run(tmp_path, netns["prefixes"], netns["hosts"], cut_for_4_s)
    assert rc0 == 0, err0[-3000:]
    _check_survivors(res0, ref)
    assert rc1 == 1 and "node 1 was taken for lost" in res1["error"], (res1, err1[-3000:])


def test_the_ranks_of_a_stalled_agent_stop_themselves_once_their_host_is_fenced(tmp_path):
    # Node 1's agent is SIGSTOPped: its beat stops but its ranks run on, in the group with ranks 0 and 1.
    # Once node 0 fences the host, ranks 2 and 3 must stop on their own at their next step (their agent
    # cannot kill them), so that ranks 0 and 1 regroup as node 0 listed them instead of training on with
    # ranks that the job reports as lost.
    def stall_agent_1(procs):
        os.kill(procs[1].pid, signal.SIGSTOP)
        procs[0].wait(timeout=150)
        ranks = [p for p in psutil.Process(procs[1].pid).children() if not _is_resource_tracker(p)]
        assert len(ranks) == 2, ranks
        assert all(r.status() == psutil.STATUS_ZOMBIE for r in ranks), [r.status() for r in ranks]
        os.kill(procs[1].pid, signal.SIGCONT)

    ref = _reference()
    (rc0, res0, err0), (rc1, res1, err1) = _run(tmp_path, [[], []], ["127.0.0.1"] * 2, stall_agent_1)
    assert rc0 == 0, err0[-3000:]
    _check_survivors(res0, ref)
    assert rc1 == 1 and ("taken for lost" in res1["error"] or "lost the store" in res1["error"]), (res1, err1)
