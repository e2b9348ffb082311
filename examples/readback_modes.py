"""Every way to read a pending output back, on the embedded digits model.

Run: python examples/readback_modes.py
"""
from __future__ import annotations

import asyncio

import numpy as np

import asyncinfer as ai
from asyncinfer import assets


async def main() -> None:
    images, labels = assets.default_samples()
    model = ai.load_model(assets.default_model_path())
    async with ai.Worker(model, "cpu") as worker:
        # 1. Await: the loop keeps running other tasks meanwhile.
        worker.schedule(images[:4])
        probs = await worker.peek_output("probabilities").readback_and_clone_async()
        print("awaited:      ", probs.numpy().argmax(axis=1), "labels", labels[:4])

        # 2. Poll: start the download, do other work, check back.
        worker.schedule(images[4:8])
        y = worker.peek_output("probabilities")
        y.readback_request()
        while not y.is_readback_request_done():
            await asyncio.sleep(0.001)  # a game loop would render a frame here
        print("polled:       ", y.readback_and_clone().numpy().argmax(axis=1))  # immediate now

        # 3. Callback: runs on this event loop when the data is ready.
        worker.schedule(images[8:12])
        y = worker.peek_output("probabilities")
        done = asyncio.Event()
        y.readback_request(lambda success: (print("callback:      success =", success), done.set()))
        await done.wait()

        # 4. The blocking twins (fine in scripts; on an event loop they stall it while computing).
        worker.schedule(images[12:16])
        y = worker.peek_output("probabilities")
        print("blocking:     ", y.readback_and_clone().numpy().argmax(axis=1))
        print("to array:     ", y.download_to_array().argmax(axis=1))
        print("from backend: ", y.data_on_backend.download().argmax(axis=1))
        print("np.asarray:   ", np.asarray(y).argmax(axis=1))

        # 5. Whole runs: safe to await concurrently, each with its own task graph.
        outs = await asyncio.gather(*(worker.run(images[i:i + 4]) for i in range(16, 32, 4)))
        print("concurrent:   ", [o["probabilities"].argmax(axis=1).tolist() for o in outs])

        # 6. Ownership: take_output survives the worker; peeked tensors belong to it.
        worker.schedule(images[:1])
        kept = worker.take_output("logits")
    print("kept after dispose:", kept.numpy().shape)


if __name__ == "__main__":
    asyncio.run(main())
