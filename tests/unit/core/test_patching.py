"""``core.patching.SharedPatch``: installed while anyone holds it, originals back after the last leaves."""

import threading

from steptune.core.patching import MISSING, SharedPatch


class Base:
    def hello(self):
        return "base"


class Child(Base):
    @classmethod
    def make(cls):
        return "own"


def test_nested_and_concurrent_holders_share_one_install_and_restore_inherited_and_own_attributes():
    patch = SharedPatch(
        lambda: [(Child, "hello", lambda self: "patched"), (Child, "make", classmethod(lambda c: 1))]
    )
    own_make = vars(Child)["make"]
    inside = threading.Event()
    leave = threading.Event()

    def other():
        with patch.held():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(5)
    with patch.held():
        assert Child().hello() == "patched" and Child.make() == 1
        assert patch.original(Child, "hello") is MISSING and patch.original(Child, "make") is own_make
    assert patch.installed and Child().hello() == "patched"  # the other thread still holds it
    leave.set()
    t.join(5)
    assert not patch.installed
    assert "hello" not in vars(Child) and Child().hello() == "base"  # inherited again, not copied down
    assert vars(Child)["make"] is own_make and Child.make() == "own"


def test_nested_holders_in_one_thread_and_a_smaller_second_install():
    targets = [(Base, "hello", lambda self: "patched"), (Child, "make", classmethod(lambda c: 1))]
    patch = SharedPatch(lambda: list(targets))
    with patch.held():
        with patch.held():
            assert Base().hello() == "patched"
        assert Base().hello() == "patched" and patch.installed  # the outer holder still holds it
    assert Base().hello() == "base" and Child.make() == "own"
    targets.pop()  # the next install replaces less: its release must not write back Child.make
    with patch.held():
        Child.make = classmethod(lambda c: "changed meanwhile")
    assert Base().hello() == "base" and Child.make() == "changed meanwhile"
    Child.make = classmethod(lambda c: "own")


def test_an_exception_inside_still_restores():
    patch = SharedPatch(lambda: [(Base, "hello", lambda self: "patched")])
    try:
        with patch.held():
            raise ValueError("boom")
    except ValueError:
        pass
    assert Base().hello() == "base" and not patch.installed


def test_a_target_named_twice_is_refused_and_nothing_stays_patched():
    patch = SharedPatch(lambda: [(Base, "hello", lambda self: 1), (Base, "hello", lambda self: 2)])
    try:
        with patch.held():
            pass
    except ValueError as err:
        assert "twice" in str(err)
    else:
        raise AssertionError("a doubled target was accepted")
    assert Base().hello() == "base"
