"""Every readback mode of DESIGN.md, on asyncio and trio, with success and failure."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import asyncinfer as ai
from conftest import LoopTicker

EXPECTED = np.full((2, 3), 2, np.float32)


@pytest.mark.anyio
async def test_readback_and_clone_async_waits_without_blocking_the_loop(gated_model):
    import anyio

    model, gate = gated_model
    async with ai.Worker(model) as worker:
        worker.schedule(np.ones((2, 3), np.float32))
        y = worker.peek_output()
        ticker = LoopTicker()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            while ticker.ticks < 50:  # the loop keeps running other tasks while the run is gated
                await anyio.sleep(0)
            gate.set()
            clone = await y.readback_and_clone_async()
            tg.cancel_scope.cancel()
    assert ticker.ticks >= 50
    np.testing.assert_array_equal(clone.numpy(), EXPECTED)
    assert not clone.is_pending


def test_readback_and_clone_blocking(gated_model):
    model, gate = gated_model
    with ai.Worker(model) as worker:
        worker.schedule(np.ones((2, 3), np.float32))
        threading.Timer(0.05, gate.set).start()
        clone = worker.peek_output().readback_and_clone()
    np.testing.assert_array_equal(clone.numpy(), EXPECTED)
    assert clone.numpy() is clone.numpy()  # a clone is plain CPU data: no more waiting


def test_polling_readback_request(gated_model):
    model, gate = gated_model
    with ai.Worker(model) as worker:
        worker.schedule(np.ones((2, 3), np.float32))
        y = worker.peek_output()
        y.readback_request()
        assert not y.is_readback_request_done()
        gate.set()
        assert y._readback_future().wait(30)
        assert y.is_readback_request_done()
        np.testing.assert_array_equal(y.readback_and_clone().numpy(), EXPECTED)


@pytest.mark.asyncio
async def test_callback_runs_on_the_loop_that_requested_it(gated_model):
    model, gate = gated_model
    loop_thread = threading.get_ident()
    seen: list[tuple[bool, int]] = []
    done = asyncio.Event()

    def callback(success: bool) -> None:
        seen.append((success, threading.get_ident()))
        done.set()

    async with ai.Worker(model) as worker:
        worker.schedule(np.ones((2, 3), np.float32))
        y = worker.peek_output()
        y.readback_request(callback)
        gate.set()
        await asyncio.wait_for(done.wait(), 30)
        assert seen == [(True, loop_thread)]
        np.testing.assert_array_equal(y.readback_and_clone().numpy(), EXPECTED)


def test_callback_without_a_loop_runs_on_the_completing_thread(gated_model):
    model, gate = gated_model
    result: dict = {}
    called = threading.Event()

    def callback(success: bool) -> None:
        result["success"], result["thread"] = success, threading.current_thread().name
        called.set()

    with ai.Worker(model) as worker:
        worker.schedule(np.ones((2, 3), np.float32))
        worker.peek_output().readback_request(callback)
        gate.set()
        assert called.wait(30)
    assert result["success"] is True
    assert result["thread"].startswith("asyncinfer-cpu")


def test_download_to_array_and_data_on_backend(gated_model):
    model, gate = gated_model
    with ai.Worker(model) as worker:
        worker.schedule(np.ones((2, 3), np.float32))
        y = worker.peek_output()
        pending_data = y.data_on_backend  # obtainable while pending; download() waits
        gate.set()
        np.testing.assert_array_equal(pending_data.download(), EXPECTED)
        a = y.download_to_array()
        b = y.data_on_backend.download()
        np.testing.assert_array_equal(a, EXPECTED)
        a[:] = 0  # downloads are copies: the tensor is untouched
        np.testing.assert_array_equal(b, EXPECTED)
        np.testing.assert_array_equal(np.asarray(y), EXPECTED)
        np.testing.assert_array_equal(y.numpy(), EXPECTED)
        assert y.shape == (2, 3) and y.dtype == np.float32 and y.backend == "cpu"


@pytest.mark.anyio
async def test_failure_reaches_every_dependent_tensor_and_the_worker_survives(failing_model):
    async with ai.Worker(failing_model) as worker:
        worker.schedule(np.zeros(2, np.float32))
        c = worker.peek_output("c")
        d = worker.peek_output("d")
        with pytest.raises(ai.ExecutionError, match="broken_layer") as info:
            await c.readback_and_clone_async()
        assert info.value.layer == "broken_layer" and info.value.op_type == "Fail"
        assert c.is_readback_request_done()
        np.testing.assert_array_equal((await d.readback_and_clone_async()).numpy(), [0, 0])  # independent branch fine
        with pytest.raises(ai.ExecutionError, match="deliberate failure"):
            c.download_to_array()
        # the worker stays usable
        worker.schedule(np.ones(2, np.float32))
        np.testing.assert_array_equal(worker.peek_output("d").download_to_array(), [3, 3])


def test_failure_callback_receives_false(failing_model):
    got = []
    called = threading.Event()
    with ai.Worker(failing_model) as worker:
        worker.schedule(np.zeros(2, np.float32))
        worker.peek_output("c").readback_request(lambda ok: (got.append(ok), called.set()))
        assert called.wait(30)
    assert got == [False]


def test_dispose_tensor():
    t = ai.Tensor(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(t.numpy(), [0, 1, 2, 3])
    t.dispose()
    with pytest.raises(ai.DisposedError):
        t.numpy()
    with pytest.raises(ai.DisposedError):
        t.readback_request()


def test_user_tensor_copies_its_source():
    source = np.arange(3, dtype=np.float32)
    t = ai.Tensor.from_numpy(source)
    source[:] = 7
    np.testing.assert_array_equal(t.numpy(), [0, 1, 2])
    assert t.shape == (3,) and not t.is_pending
