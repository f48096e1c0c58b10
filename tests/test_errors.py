"""One error out of a failed task group: which one, and nothing else lost."""

from __future__ import annotations

import logging

import anyio
import pytest

from asyncrefit import WorkerDiedError
from asyncrefit._exceptions import one_error


async def test_one_error_raises_the_workers_error_and_keeps_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ready = anyio.Event()

    async def dies() -> None:
        await ready.wait()
        raise WorkerDiedError("w0", "exit code -9")

    async def breaks() -> None:
        # Fails too, after the first failure cancelled the group (its cleanup shielded).
        with anyio.CancelScope(shield=True):
            ready.set()
            await anyio.sleep(0.01)
        raise ValueError("a bug beside it")

    caplog.set_level(logging.DEBUG, logger="asyncrefit")
    with pytest.raises(WorkerDiedError) as info:
        with one_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(dies)
                tg.start_soon(breaks)
    notes = getattr(info.value, "__notes__", [])
    assert any("ValueError: a bug beside it" in note for note in notes), notes
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[1] is not info.value]
    assert [type(r.exc_info[1]) for r in logged if r.exc_info] == [ValueError]


async def test_one_error_adds_nothing_when_there_is_one() -> None:
    async def dies() -> None:
        raise WorkerDiedError("w0", "gone")

    with pytest.raises(WorkerDiedError) as info:
        with one_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(dies)
    assert not getattr(info.value, "__notes__", [])
