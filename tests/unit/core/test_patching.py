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


def test_an_exception_inside_still_restores():
    patch = SharedPatch(lambda: [(Base, "hello", lambda self: "patched")])
    try:
        with patch.held():
            raise ValueError("boom")
    except ValueError:
        pass
    assert Base().hello() == "base" and not patch.installed
