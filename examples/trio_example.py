"""The same engine awaited under trio: readback, concurrent runs in a nursery, a callback.

asyncinfer's awaitables work under asyncio and trio alike (the engine detects the running loop
with sniffio and wakes it thread-safely), so nothing here is trio-specific except ``trio.run``,
the nursery and ``trio.Event``.

Run: python examples/trio_example.py
"""
from __future__ import annotations

import numpy as np
import trio

import asyncinfer as ai
from asyncinfer import assets


async def main() -> None:
    images, labels = assets.default_samples()
    model = ai.load_model(assets.default_model_path())

    async with ai.Worker(model, "cpu") as worker:  # disposed (off the loop) when the block ends
        # 1. Schedule returns at once; awaiting the readback suspends only this task.
        worker.schedule(images)
        probs = await worker.peek_output("probabilities").readback_and_clone_async()
        accuracy = float((probs.numpy().argmax(axis=1) == labels).mean())
        print(f"trio readback: accuracy {accuracy:.3f} on {len(labels)} samples")

        # 2. Several runs at once in a nursery; each has its own task graph.
        chunks = np.array_split(np.arange(len(labels)), 4)
        results: dict[int, np.ndarray] = {}

        async def classify(i: int, idx: np.ndarray) -> None:
            outs = await worker.run(images[idx])
            results[i] = outs["probabilities"].argmax(axis=1)

        async with trio.open_nursery() as nursery:
            for i, idx in enumerate(chunks):
                nursery.start_soon(classify, i, idx)
        for i, idx in enumerate(chunks):
            correct = int((results[i] == labels[idx]).sum())
            print(f"trio nursery run {i}: {correct}/{len(idx)} correct, first digits {results[i][:5].tolist()}")

        # 3. A callback: delivered on this trio loop when the download is done.
        worker.schedule(images[:8])
        y = worker.peek_output("probabilities")
        done = trio.Event()

        def on_ready(success: bool) -> None:
            print(f"trio callback: success = {success}")
            done.set()  # safe: the callback runs on the trio loop, not a worker thread

        y.readback_request(on_ready)
        await done.wait()
        print("trio callback digits:", y.readback_and_clone().numpy().argmax(axis=1).tolist())  # immediate now


if __name__ == "__main__":
    trio.run(main)
