"""TIDE's collectives on NCCL: needs two CUDA devices (skipped, not failed, without them)."""

import datetime
import multiprocessing as mp

import pytest
import torch

from steptune.comm.transport import MIN_NCCL, nccl_version

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2 or nccl_version() < MIN_NCCL,
        reason="needs 2 CUDA devices and NCCL >= 2.18",
    ),
]


def _rank(rank, port, results):
    import torch.distributed as dist

    from steptune.comm.config import TideConfig
    from steptune.comm.selftest import self_test

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "nccl", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        results.put((rank, self_test(dist.group.WORLD, torch.device("cuda", rank), TideConfig())))
    finally:
        dist.destroy_process_group()


def test_self_test_on_two_gpus():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    verdicts = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    assert verdicts == {0: None, 1: None}
