"""Multi-rank test harness: thread ranks on real gloo groups, and a spawn pool for process ranks.

from steptune.testing import run_threads, SpawnPool
results = run_threads(fn, world_size=4)        # fn(rank, group, *args) in 4 threads
with SpawnPool(2) as pool:                     # 2 processes, spawned once, reused
    results = pool.run(fn)                     # fn must be a top-level, importable function
"""

from steptune.testing.spawn import SpawnPool
from steptune.testing.threads import RankFailure, run_threads

__all__ = ["RankFailure", "SpawnPool", "run_threads"]
