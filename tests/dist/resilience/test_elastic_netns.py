"""``elastic`` across two hosts that are really apart: two network namespaces joined by a veth pair
(10.77.0.1 and 10.77.0.2, no loopback between them), one host agent in each, and a network partition
(a blackhole qdisc on both ends: packets vanish silently, as when a switch port dies) made from outside
mid-run. Node 1 finds its own address from the route to node 0. Needs root (``ip netns``); skipped
otherwise."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steptune.core.dist import master_store
from steptune.resilience.elastic import Elastic

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

NODE = Path(__file__).with_name("netns_node.py")
SRC = Path(__file__).resolve().parents[3] / "src"
STEPS = 24


def _ip(*args, ns=None, check=True):
    cmd = [*(["ip", "netns", "exec", ns] if ns else []), "ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def hosts():
    """Two namespaces, ``a`` (node 0, 10.77.0.1) and ``b`` (node 1, 10.77.0.2), and a ``cut(on)`` that
    partitions or heals the link between them."""
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

        yield {"a": a, "b": b, "cut": cut}
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)


def _reference():
    spec = importlib.util.spec_from_file_location("netns_node", NODE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.train(Elastic(master_store(), 0, [0], timeout_s=5), STEPS, None)


def _run(hosts, tmp_path, hold_s):
    """Both agents; the link is cut when rank 0 reaches step 3 and healed after ``hold_s`` seconds (None:
    once node 0 has finished). Returns each node's (exit code, JSON line, stderr)."""
    mark, master = tmp_path / "mark", f"file:{tmp_path / 'rdzv'}"
    path = f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmds = [
        [
            "ip",
            "netns",
            "exec",
            hosts[ns],
            sys.executable,
            str(NODE),
            str(k),
            master,
            host,
            str(STEPS),
            str(mark),
        ]
        for k, ns, host in ((0, "a", "10.77.0.1"), (1, "b", "auto"))
    ]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    procs = [subprocess.Popen(c, **pipes) for c in cmds]
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate(timeout=30)
            time.sleep(0.02)
        hosts["cut"](True)
        if hold_s is None:
            procs[0].wait(timeout=150)
        else:
            time.sleep(hold_s)
        hosts["cut"](False)
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [
        (p.returncode, json.loads(out.strip().splitlines()[-1]), err)
        for p, (out, err) in zip(procs, outs, strict=True)
    ]


def _check_survivors(res0, ref):
    assert res0["survivors"] == [0, 1] and res0["lost"] == {"2": None, "3": None}, res0
    losses = {int(k): v for k, v in res0["losses"].items()}
    assert sorted(losses) == list(range(STEPS)), res0
    assert max(abs(losses[k] - ref[k]) / abs(ref[k]) for k in ref) <= 1e-5, (losses, ref)
    assert [r["members"] for r in res0["recoveries"]] == [[0, 1]], res0


def test_a_partition_that_outlasts_the_job_loses_the_cut_off_host(hosts, tmp_path):
    # Node 0 hears no beat for 2 s, fences node 1 and lists ranks 0 and 1; their all-reduce with the cut-off
    # ranks times out (8 s) and they redo the step alone. Node 1 waits on the store until its 60 s timeout
    # ends (or the healed link finds the store gone) and stops its ranks with a message that says so.
    ref = _reference()
    (rc0, res0, err0), (rc1, res1, err1) = _run(hosts, tmp_path, None)
    assert rc0 == 0, err0[-3000:]
    _check_survivors(res0, ref)
    assert rc1 == 1 and "node 1 lost the store at 10.77.0.1:" in res1["error"], (res1, err1[-3000:])


def test_a_partition_healed_after_the_host_was_fenced_stops_its_ranks(hosts, tmp_path):
    # Healed after 4 s: past the 2 s node timeout, before the 8 s group timeout. The all-reduce stuck
    # across the cut completes once packets flow again, so every rank goes on for a moment; then node 1's
    # agent reads its fence, kills its ranks, and the survivors rejoin and redo the step they were in.
    ref = _reference()
    (rc0, res0, err0), (rc1, res1, err1) = _run(hosts, tmp_path, 4.0)
    assert rc0 == 0, err0[-3000:]
    _check_survivors(res0, ref)
    assert rc1 == 1 and "node 1 was taken for lost" in res1["error"], (res1, err1[-3000:])
