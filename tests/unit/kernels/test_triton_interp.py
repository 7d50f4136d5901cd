"""Triton candidates on CPU run under the interpreter: a correct kernel passes (untimed), an unmasked one
that reads and writes past its tensors is caught without harming the pool. Needs the `triton` extra."""

from pathlib import Path

import pytest

pytest.importorskip("triton")

from steptune.kernels.pool import EvalPool, PoolConfig

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[3] / "src/steptune/kernels/examples/softmax/triton_kernel.py"


def test_triton_interpreter_correct_and_oob():
    good = EXAMPLE.read_text()
    # drop the masks: every program reads and writes a power-of-two block past its row (OOB on the last row)
    oob = good.replace(', mask=mask, other=-float("inf")', "").replace(", mask=mask)", ")")
    oob = oob.replace("BLOCK=triton.next_power_of_2(cols)", "BLOCK=2 * triton.next_power_of_2(cols)")
    assert oob != good
    with EvalPool(PoolConfig(num_workers=1, timeout_s=120)) as pool:
        res = pool.evaluate("softmax", good)
        assert res.verdict == "correct", res.reason
        assert res.speedup is None and "interpreter" in res.reason
        bad = pool.submit("softmax", oob).result(180)
        assert bad.verdict in ("crashed", "incorrect"), bad.reason
        assert pool.submit("softmax", good).result(180).verdict == "correct"
