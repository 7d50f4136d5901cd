"""Scenario generator and CSV traces."""

from pathlib import Path

import pytest

from steptune.resilience.scenarios import KINDS, LINK_FACTORS, SEVERITY, generate, read_csv, write_csv


@pytest.mark.parametrize("kind", KINDS)
def test_generate_is_seeded_and_in_range(kind: str) -> None:
    a = generate(kind, num_devices=256, duration_s=7200.0, seed=3)
    assert a == generate(kind, num_devices=256, duration_s=7200.0, seed=3)
    assert a != generate(kind, num_devices=256, duration_s=7200.0, seed=4)
    assert a and all(0 <= f.device < 256 and 0 <= f.start_s < 7200.0 for f in a)
    stops = [f.device for f in a if f.kind == "fail-stop"]
    assert len(stops) == len(set(stops))  # a device dies once
    if kind == "fail-slow-link":
        assert all(f.target == "link" and LINK_FACTORS[0] <= f.factor <= LINK_FACTORS[1] for f in a)
    elif kind.startswith("fail-slow-"):
        assert {f.factor for f in a} == {SEVERITY[kind.removeprefix("fail-slow-")]}
        assert {f.target for f in a} == {"compute"}


def test_rates_match_the_presets() -> None:
    n = [len(generate("fail-stop", num_devices=256, duration_s=7200.0, seed=s)) for s in range(40)]
    assert 3.0 < sum(n) / len(n) < 5.0  # every 30 minutes over 2 hours: 4 on average


def test_csv_round_trip_and_errors(tmp_path: Path) -> None:
    fails = generate("mixed", num_devices=64, duration_s=7200.0, seed=1)
    p = tmp_path / "t.csv"
    write_csv(fails, p)
    assert read_csv(p, num_devices=64) == fails
    assert p.read_text().startswith("kind,device,start_s,duration_s,factor\n")  # no target column
    with pytest.raises(ValueError, match="not among the job's 8 devices"):
        read_csv(p, num_devices=8)
    links = generate("fail-slow-link", num_devices=64, duration_s=7200.0, seed=1) + fails
    write_csv(links, p)
    assert p.read_text().startswith("kind,device,start_s,duration_s,factor,target\n")
    assert read_csv(p) == links
    bad = tmp_path / "bad.csv"
    head = "kind,device,start_s,duration_s,factor\n"
    # range errors name the column too (they named the line only)
    for row, column in (
        ("fail-slow,1,10,inf,1.7", "factor"),
        ("fail-slow,-1,10,inf,0.5", "device"),
        ("fail-slow,1,-3,inf,0.5", "start_s"),
        ("fail-slow,1,10,0,0.5", "duration_s"),
        ("fail-slo,1,10,inf,0.5", "kind"),
        ("fail-stop,1,10,inf,nan", "factor"),  # ignored by a fail-stop, but a NaN broke simulate --json
    ):
        bad.write_text(head + row + "\n")
        with pytest.raises(ValueError, match=rf"bad\.csv:2: column {column}: "):
            read_csv(bad)
    bad.write_text(head.replace("factor", "factor,target") + "fail-stop,1,10,inf,1,link\n")
    with pytest.raises(ValueError, match=r"bad\.csv:2: column target: "):
        read_csv(bad)
    # a session-48 sweep: these said what was wrong but not what to write
    bad.write_text(head.replace("factor", "factor,target") + "fail-slow,1,10,inf,0.5\n")
    with pytest.raises(ValueError, match=r"every row names one: compute or link"):
        read_csv(bad)
    bad.write_text(head + "fail-slow-link,1,10,inf,0.5\n")
    with pytest.raises(ValueError, match=r"column kind: .*write the row as fail-slow with a target column"):
        read_csv(bad)
    bad.write_text(head + "fail-slow,9,10,inf,0.5\n")
    with pytest.raises(ValueError, match=r"bad\.csv:2: column device: .*\(0\.\.7\)"):
        read_csv(bad, num_devices=8)
    bad.write_text("kind,device,start_s,duration_s,factor\nfail-slow,1,10,inf,5e-324\n")
    with pytest.raises(ValueError, match=r"bad\.csv:2: .*hung; write it as a fail-stop"):
        read_csv(bad)  # was an infinite stage cost deep in the simulator
    (tmp_path / "h.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="header"):
        read_csv(tmp_path / "h.csv")
    with pytest.raises(ValueError, match="unknown scenario kind"):
        generate("meteor", num_devices=8, duration_s=10.0)
