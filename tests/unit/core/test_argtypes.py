"""The CLIs' number converters: what they accept, and that a refusal says what the flag needs."""

import argparse
from pathlib import Path

import pytest

from steptune.cli import build_parser
from steptune.core.argtypes import (
    non_negative_float,
    output_dir,
    output_file,
    plot_file,
    positive_float,
    positive_int,
    warn_ignored,
)


def test_accepted_values():
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5 and non_negative_float("0") == 0.0


@pytest.mark.parametrize(
    ("convert", "text", "message"),
    [
        (positive_int, "0", "must be >= 1"),
        (positive_int, "2.5", "expected a whole number >= 1"),
        (positive_int, "x", "expected a whole number >= 1"),
        (positive_float, "0", "must be > 0 and finite"),
        (positive_float, "inf", "must be > 0 and finite"),
        (positive_float, "nan", "must be > 0 and finite"),
        (non_negative_float, "-2", "must be >= 0 and finite"),
        (non_negative_float, "abc", "expected a number >= 0"),
    ],
)
def test_refusals_say_what_is_needed(convert, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        convert(text)


def test_output_paths_are_checked_before_any_work(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert output_file(str(tmp_path / "new" / "deeper" / "x.json")) == tmp_path / "new" / "deeper" / "x.json"
    assert output_dir(str(tmp_path / "new")) == tmp_path / "new"
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory; give a file path inside it"):
        output_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="afile is a file, not a folder"):
        output_file(str(afile / "x.json"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
        output_dir(str(afile))
    # Found in a sweep (2026-12-05): root passes os.access on /proc, so the whole search ran before the
    # write failed; a real file is tried now, and nothing is left behind
    if Path("/proc/self").is_dir():
        with pytest.raises(argparse.ArgumentTypeError, match="/proc does not take new files"):
            output_file("/proc/best.py")
    output_file(str(tmp_path / "x.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_options_that_do_not_apply_are_warned_of_only_when_set(capsys):
    parser = build_parser()
    args = parser.parse_args(["kernels", "bench", "--lane", "cpu", "--wall", "5", "--seeds", "3"])
    assert warn_ignored(args, ["seeds", "sweep", "repeats"], "with --lane cpu") == ["--seeds"]
    assert "steptune kernels bench: warning: --seeds has no effect with --lane cpu" in capsys.readouterr().err
    args = parser.parse_args(["kernels", "bench", "--lane", "cpu", "--seeds", "20"])  # the default: silent
    assert warn_ignored(args, ["seeds"], "with --lane cpu") == []
    args = parser.parse_args(["resilience", "run", "--tp-policy", "uneven"])
    assert warn_ignored(args, ["tp_policy"], "without tp > 1") == ["--tp-policy"]


def test_a_plot_path_needs_an_image_suffix_before_the_run(tmp_path):
    assert plot_file(str(tmp_path / "p.PNG")) == tmp_path / "p.PNG"
    with pytest.raises(argparse.ArgumentTypeError, match=r"ending in \.png, say .*p\.png"):
        plot_file(str(tmp_path / "p.txt"))
    with pytest.raises(SystemExit) as stop:  # memory pareto used to fail only after the whole run
        build_parser().parse_args(["memory", "pareto", "--out", str(tmp_path / "p.txt")])
    assert stop.value.code == 2


def test_byte_sizes_take_units_and_indices_take_zero():
    from steptune.core.argtypes import byte_size, non_negative_int

    assert byte_size("80e9") == 80e9 and byte_size("80GB") == 80e9 and byte_size("141GiB") == 141 * 2**30
    assert byte_size("300 MiB") == 300 * 2**20 and byte_size("512b") == 512
    for bad, says in (
        ("80 gigs", "expected bytes such as"),
        ("0GB", "must be > 0"),
        ("infGB", "must be > 0"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            byte_size(bad)
    assert non_negative_int("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 0"):
        non_negative_int("-1")
