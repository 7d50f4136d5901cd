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


@pytest.mark.timeout(120)
def test_a_forkserver_rank_starts_with_torch_dynamo_imported():
    # A rank's first optimizer call imports torch._dynamo (2.3 s of CPU here) unless the server did.
    with start_context("forkserver").Pool(1) as pool:
        assert pool.apply(eval, ("'torch._dynamo' in __import__('sys').modules",))
