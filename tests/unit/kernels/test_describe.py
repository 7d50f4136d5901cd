"""`kernels eval`'s report of one result."""

from steptune.kernels.cli import describe
from steptune.kernels.pool import Result


def _profiled(ratios: list[float], **extra: object) -> Result:
    res = Result(verdict="correct", kind="profile", speedup=0.80, ref_time_s=7.0e-4, candidate_time_s=7.19e-4)
    res.problem = "relu"
    res.extra = {"rounds": len(ratios), "round_ratios": ratios, **extra}
    return res


def test_a_noisy_profile_says_so_and_a_steady_one_does_not():
    # A sweep: "speedup 0.80x, reference 0.700 ms, candidate 0.719 ms" with per-round ratios 0.31-1.15 and
    # no word of the noise (the times divide to 0.97x)
    noisy = describe(_profiled([0.31, 0.8, 1.15], unseen_speedup=0.9, unseen_draw_ratios=[0.9] * 5), "k.py")
    assert "noise      per-round ratios 0.31-1.15x" in noisy
    assert "unseen     0.90x on 5 draws not timed before" in noisy
    steady = describe(_profiled([0.78, 0.8, 0.83]), "k.py")
    assert "noise" not in steady and "unseen" not in steady
    note = "not compared: the draws differ in shapes or non-tensor inputs"
    skipped = describe(_profiled([0.8], unseen_speedup=2.0, unseen_draw_ratios=[2.0], unseen_note=note), "k")
    assert f"on 1 draws not timed before (one call each); {note}" in skipped


def test_a_suspicious_speedup_says_it_is_not_credited():
    # A review: the reason said "withheld" while eval printed the speedup as any other
    text = describe(_profiled([6.4, 6.5], suspicious=True), "k.py")
    assert "SUSPICIOUS: not credited by optimize" in text
    assert "SUSPICIOUS" not in describe(_profiled([0.8, 0.8]), "k.py")
