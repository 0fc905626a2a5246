"""``ModelName``: the one parser and writer of ``[project/]name[@step]``. Parsing never fails;
a step that is not a plain decimal number is kept as written (the gateway refuses it, naming
it), and writing gives back what was parsed. The call admission a swap lock hands out is
released once, however often its holders let go."""

from __future__ import annotations

import asyncio

import pytest

from tracerl.backend.gateway.served import ReleaseRouting, canary_bucket
from tracerl.backend.gateway.swap_lock import SwapLock
from tracerl.core.engine import EngineTimeoutError
from tracerl.core.model_name import ModelName

# text: (base, project, name, step_text, step)
NAMES = {
    "agent": ("agent", None, "agent", None, None),
    "alpha/agent": ("alpha/agent", "alpha", "agent", None, None),
    "alpha/agent@3": ("alpha/agent", "alpha", "agent", "3", 3),
    "agent@0": ("agent", None, "agent", "0", 0),
    "agent@007": ("agent", None, "agent", "007", 7),
    "agent@": ("agent", None, "agent", "", None),
    "agent@x": ("agent", None, "agent", "x", None),
    "agent@-1": ("agent", None, "agent", "-1", None),
    "agent@ 3": ("agent", None, "agent", " 3", None),
    "agent@\u00b2": ("agent", None, "agent", "\u00b2", None),  # isdigit() says yes; int() no
    "agent@\u0663": ("agent", None, "agent", "\u0663", None),  # an Arabic-Indic three
    "agent@3@4": ("agent", None, "agent", "3@4", None),  # split at the first @ only
    "a/b/c@2": ("a/b/c", "a", "b/c", "2", 2),  # the project ends at the first /
    "p/a@x/y": ("p/a", "p", "a", "x/y", None),  # a / after the @ is the step's
    "@5": ("", None, "", "5", 5),
    "/agent": ("/agent", "", "agent", None, None),
    "": ("", None, "", None, None),
}


@pytest.mark.parametrize("text", list(NAMES))
def test_a_name_parses_into_its_parts_and_writes_back_as_it_was(text: str) -> None:
    base, project, name, step_text, step = NAMES[text]
    parsed = ModelName.parse(text)
    assert (parsed.base, parsed.project, parsed.name, parsed.step_text, parsed.step) == (
        base, project, name, step_text, step)
    assert parsed.pinned == (step_text is not None)
    assert parsed.qualified == (project is not None)
    assert str(parsed) == text
    assert parsed.local == ModelName(name, step_text)

def test_of_writes_a_step_and_leaves_an_unpinned_name_alone() -> None:
    assert str(ModelName.of("alpha/agent", 3)) == "alpha/agent@3"
    assert str(ModelName.of("alpha/agent", 0)) == "alpha/agent@0"
    assert str(ModelName.of("alpha/agent")) == "alpha/agent"
    assert ModelName.parse(str(ModelName.of("agent", 12))).step == 12
    assert ModelName.parse("alpha/agent@3") == ModelName.of("alpha/agent", 3)


def test_release_routing_sends_the_canary_share_by_a_sticky_hash() -> None:
    routing = ReleaseRouting(incumbent=1, candidate=2, share=0.5)
    ids = [f"r{i}" for i in range(200)]
    assert all(routing.pick(rid) == (2 if canary_bucket(rid) < 0.5 else 1) for rid in ids)
    assert {routing.pick(rid) for rid in ids} == {1, 2}
    assert routing.pick(None) == 1 and routing.steps() == {1, 2}
    assert ReleaseRouting(3).pick("r1") == 3 and ReleaseRouting(3).steps() == {3}


async def test_an_admission_is_released_once_by_its_holder() -> None:
    lock = SwapLock("p/m")
    with await lock.admit(1.0) as admission:
        assert lock.readers == 1 and admission.held
    assert lock.readers == 0 and not admission.held
    admission.release()  # again: nothing happens
    assert lock.readers == 0

    held = await lock.admit(1.0)
    swap_started = asyncio.Event()

    async def swap() -> None:
        async with lock.swapping(5.0):
            swap_started.set()

    swapping = asyncio.ensure_future(swap())
    await asyncio.sleep(0.05)
    assert not swap_started.is_set()  # waits for the call in flight
    held.release()
    await asyncio.wait_for(swapping, 5.0)
    assert lock.readers == 0


async def test_retiring_a_version_waits_for_its_calls_and_admits_new_ones() -> None:
    lock = SwapLock("p/m")
    old = await lock.admit(1.0)
    old.serve("p/m@1")
    other = await lock.admit(1.0)
    other.serve("p/m@2")
    retired = asyncio.Event()

    async def retire() -> None:
        async with lock.retiring(["p/m@1"], 5.0):
            retired.set()

    retiring = asyncio.ensure_future(retire())
    with await asyncio.wait_for(lock.admit(1.0), 1.0) as new:  # not held by the retirement
        new.serve("p/m@2")
        assert "1 of them use the retired versions ['p/m@1']" in lock.describe()
    other.release()
    for _ in range(5):  # the retirement runs on this loop: let it see the release
        await asyncio.sleep(0)
    assert not retired.is_set()  # the call on version 1 is still in flight
    old.release()
    await asyncio.wait_for(retiring, 5.0)
    with await lock.admit(1.0) as late:
        late.serve("p/m@1")
        with pytest.raises(EngineTimeoutError, match=r"1 call\(s\) in flight on the retired"):
            async with lock.retiring(["p/m@1"], 0.1):
                pass
