"""The adversarial suite: every cheating, broken or hostile candidate gets its expected verdict, no process
it started survives it, and the pool keeps serving (a control candidate passes after each one)."""

import re
from pathlib import Path

import psutil
import pytest

from steptune.kernels.checks import static_check
from steptune.kernels.pool import EvalPool, PoolConfig

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ADV = Path(__file__).resolve().parents[3] / "src/steptune/kernels/examples/adversarial"
CASES = sorted(ADV.glob("*.py"))
CONTROL = (ADV / "honest_torch.py").read_text()


def _expect(path: Path, key: str) -> str | None:
    return dict(re.findall(r"^# (expect|runtime): (\w+)$", path.read_text(), re.M)).get(key)


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


@pytest.fixture(scope="module")
def pools():
    cfg = dict(num_workers=2, timeout_s=8, memory_bytes=2**30)
    before = _descendants()  # e.g. multiprocessing's resource tracker, started by earlier tests
    with EvalPool(PoolConfig(**cfg)) as checked, EvalPool(PoolConfig(**cfg, static_checks=False)) as runtime:
        yield checked, runtime, before


def test_suite_is_big_enough():
    assert len(CASES) >= 13
    verdicts = {_expect(p, "expect") for p in CASES}
    assert {
        "incorrect",
        "rejected",
        "crashed",
        "timeout",
        "compile_error",
        "resource_limit",
        "correct",
    } <= verdicts


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_verdict_and_cleanup(pools, path):
    checked, runtime, before = pools
    source = path.read_text()
    if not static_check(source) and _expect(path, "runtime"):
        # Nothing for the static checks to stop: the checked pool runs it exactly as the run-time one
        # would (static_checks only gates submit), so that run is the run-time check; a second run of the
        # same code in the other pool cost up to 6 s (kills_worker sleeps 5 s).
        assert _expect(path, "runtime") == _expect(path, "expect"), path.stem
        runs = ((checked, "expect"),)
    else:
        runs = ((checked, "expect"), (runtime, "runtime"))
    for pool, key in runs:
        want = _expect(path, key)
        if want is None:
            continue
        res = pool.submit("softmax", source, kind="validate").result(timeout=60)
        assert res.verdict == want, f"{path.stem} ({key}): {res.verdict}: {res.reason}"
        assert res.reason or want == "correct"
        if want in ("timeout", "resource_limit"):  # killed by us: its own dying process is no leftover
            assert "left" not in res.reason, res.reason
        # nothing the candidate started survives: only the pool's own workers remain below us
        own = {*checked.worker_pids(), *runtime.worker_pids(), checked.template_pid, runtime.template_pid}
        assert _descendants() - before <= own
        # and the pool keeps serving
        assert pool.submit("softmax", CONTROL).result(timeout=60).verdict == "correct"


def test_runtime_checks_catch_what_static_checks_catch_first(pools):
    """Cheats the static checks stop must also be stopped at run time, where the suite marks it."""
    marked = [p for p in CASES if _expect(p, "runtime")]
    assert len(marked) >= 4


def test_no_processes_after_close():
    before = _descendants()  # other tests' pools may still be alive
    with EvalPool(PoolConfig(num_workers=1, timeout_s=8)) as pool:
        res = pool.submit("softmax", (ADV / "leaves_child_process.py").read_text()).result(timeout=60)
        assert res.verdict == "rejected" and "process" in res.reason
        assert res.extra["leftover_processes"] >= 1
    assert _descendants() <= before
