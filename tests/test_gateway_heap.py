"""The heap freeze after registering a model (``freeze_long_lived_objects``)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from tracerl.backend.local import freeze_long_lived_objects


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_garbage_an_earlier_freeze_held_is_reclaimed_by_the_next(monkeypatch):
    monkeypatch.delenv("TRACERL_GC_FREEZE", raising=False)
    dropped = Cycle()
    alive = weakref.ref(dropped)
    freeze_long_lived_objects()  # `dropped` is frozen now
    del dropped
    gc.collect()
    assert alive() is not None  # a frozen cycle survives an ordinary collection
    freeze_long_lived_objects()
    assert alive() is None
    gc.unfreeze()


@pytest.mark.parametrize("setting, frozen", [("0", False), ("1", True)])
def test_the_freeze_can_be_turned_off(setting, frozen):
    code = ("import gc; from tracerl.backend.local import freeze_long_lived_objects; "
            "freeze_long_lived_objects(); print(gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"TRACERL_GC_FREEZE": setting, "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": ":".join(sys.path)}, check=True).stdout
    assert (int(out) > 0) is frozen
