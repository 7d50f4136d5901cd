import pytest

from steptune.core.dist import START_METHOD_ENV, start_context


def test_the_argument_wins_over_the_environment_which_wins_over_spawn(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert start_context().get_start_method() == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    assert start_context().get_start_method() == "forkserver"
    assert start_context("spawn").get_start_method() == "spawn"


def test_an_unknown_method_names_the_choices_and_the_variable(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=r"'spawn' or 'forkserver', got 'fork'") as err:
        start_context()
    assert "(the argument, or $STEPTUNE_START_METHOD)" in str(err.value)
