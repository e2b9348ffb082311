"""A FastAPI app that classifies handwritten digits with the embedded model, awaiting the engine.

The worker is built once in the app's lifespan and disposed at shutdown. Handlers ``await``
``worker.run(...)``: the event loop keeps serving other requests while the CPU thread pool
computes, and concurrent requests run in parallel, each with its own task graph.

Run either of:

    uvicorn examples.web_app:app            # from the repository root
    python examples/web_app.py [--port 8000]

Then:

    curl -s 127.0.0.1:8000/healthz
    curl -s -X POST 127.0.0.1:8000/classify -H 'content-type: application/json' \\
         -d '{"pixels": [[0,0,0,0,0,0,0,0], ... 8 rows of 8 floats in [0, 1] ...]}'
"""
from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field

import asyncinfer as ai
from asyncinfer import assets

MAX_BATCH = 256  # refuse huge requests up front rather than tie up the thread pool


class ClassifyRequest(BaseModel):
    """One 8x8 image (a list of 8 rows of 8 floats in [0, 1]) or a list of such images."""

    pixels: list[Any] = Field(description="an 8x8 image, or a list of 8x8 images (N x 8 x 8)")


class ClassifyResponse(BaseModel):
    predictions: list[int]              # the most likely digit of each image
    probabilities: list[list[float]]    # per image, the probability of each digit 0..9


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Loading and building the worker happen once, before the first request is served.
    model = ai.load_model(assets.default_model_path())
    worker = ai.Worker(model, "cpu")
    app.state.worker = worker
    app.state.input_name = model.inputs[0].name        # "image", [N, 1, 8, 8] float32
    try:
        yield
    finally:
        await worker.dispose_async()  # joins the worker's threads off the event loop


app = FastAPI(title="asyncinfer digits", lifespan=lifespan)


def to_batch(pixels: list[Any]) -> np.ndarray:
    """Turn the JSON pixels into the model's [N, 1, 8, 8] float32 batch, or raise a 422."""
    try:
        array = np.asarray(pixels, dtype=np.float32)
    except (ValueError, TypeError):
        raise HTTPException(422, "pixels must be a rectangular array of numbers: "
                                 "8 rows of 8 floats, or a list of such images") from None
    sent = array.shape
    if array.ndim == 2:          # one image -> a batch of one
        array = array[None]
    if array.ndim == 4 and array.shape[1] == 1:  # already [N, 1, 8, 8]
        array = array[:, 0]
    if array.ndim != 3 or array.shape[1:] != (8, 8):
        raise HTTPException(422, f"pixels must have shape (8, 8) or (N, 8, 8), got {sent}")
    if not 1 <= array.shape[0] <= MAX_BATCH:
        raise HTTPException(422, f"send between 1 and {MAX_BATCH} images, got {array.shape[0]}")
    if not np.isfinite(array).all():
        raise HTTPException(422, "pixels must be finite numbers")
    return array[:, None]       # add the channel axis: [N, 1, 8, 8]


@app.post("/classify", response_model=ClassifyResponse)
async def classify(body: ClassifyRequest, request: Request) -> ClassifyResponse:
    state = request.app.state
    batch = to_batch(body.pixels)
    try:
        # Awaiting never blocks the loop: other requests are served while this one computes.
        outputs = await state.worker.run({state.input_name: batch})
    except ai.InputError as error:  # the model's own shape/type check, should to_batch miss one
        raise HTTPException(422, str(error)) from None
    probs = outputs["probabilities"]
    return ClassifyResponse(predictions=probs.argmax(axis=1).tolist(), probabilities=probs.tolist())


@app.get("/healthz")
async def healthz(request: Request) -> dict[str, str]:
    worker: ai.Worker = request.app.state.worker
    return {"status": "ok" if not worker.disposed else "disposed", "backend": worker.backend_type.value}


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)
