"""The examples run as a user would run them: the web app, the notebook, the trio script.

(examples/readback_modes.py is run by tests/test_cli.py.)
"""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

import asyncinfer as ai
from conftest import free_port
from asyncinfer import assets

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def samples() -> tuple[np.ndarray, np.ndarray]:
    return assets.default_samples()


@pytest.fixture(scope="module")
def expected_digits(samples) -> np.ndarray:
    """What Worker.run predicts for the first 16 samples: the web app must agree."""
    images, _ = samples
    with ai.Worker(ai.load_model(assets.default_model_path()), "cpu") as worker:
        return worker.run_blocking(images[:16])["probabilities"].argmax(axis=1)


@pytest.fixture(scope="module")
def web_app():
    return importlib.import_module("examples.web_app")  # as `uvicorn examples.web_app:app` does


# -- web app -------------------------------------------------------------------------------------

@asynccontextmanager
async def serving(app) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan (startup, then shutdown on exit) around an httpx client on its ASGI."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            yield client


@pytest.mark.anyio
async def test_web_app_classifies_through_asgi(web_app, samples, expected_digits):
    app = web_app.app
    images, _ = samples
    async with serving(app) as client:
        worker = app.state.worker
        health = await client.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "ok"

        # A batch of images, as nested lists [N][8][8].
        response = await client.post("/classify", json={"pixels": images[:16, 0].tolist()})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["predictions"] == expected_digits.tolist()
        probs = np.asarray(body["probabilities"])
        assert probs.shape == (16, 10)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-4)

        # A single 8x8 image is a batch of one; [N, 1, 8, 8] is accepted as well.
        single = await client.post("/classify", json={"pixels": images[3, 0].tolist()})
        assert single.status_code == 200, single.text
        assert single.json()["predictions"] == [int(expected_digits[3])]
        nchw = await client.post("/classify", json={"pixels": images[:2].tolist()})
        assert nchw.json()["predictions"] == expected_digits[:2].tolist()

        # Concurrent requests each get their own answer.
        responses = await _gather(*(client.post("/classify", json={"pixels": images[i, 0].tolist()})
                                    for i in range(8)))
        assert [r.json()["predictions"][0] for r in responses] == expected_digits[:8].tolist()
    assert worker.disposed  # the lifespan's shutdown disposed the worker


async def _gather(*awaitables):
    """asyncio.gather for asyncio and trio alike (anyio task group)."""
    import anyio

    results = [None] * len(awaitables)

    async def one(i, awaitable):
        results[i] = await awaitable

    async with anyio.create_task_group() as tg:
        for i, awaitable in enumerate(awaitables):
            tg.start_soon(one, i, awaitable)
    return results


@pytest.mark.anyio
async def test_web_app_rejects_bad_requests(web_app):
    async with serving(web_app.app) as client:
        # Wrong shape: a clear 4xx that says what was expected and what came.
        bad = await client.post("/classify", json={"pixels": [[0.0] * 7] * 8})
        assert bad.status_code == 422
        assert bad.json()["detail"] == "pixels must have shape (8, 8) or (N, 8, 8), got (8, 7)"
        cases = [
            {"pixels": [[1, 2], [3, 4]]},                 # wrong shape
            {"pixels": [[[0.0] * 8] * 8] * 2 + [[0.0]]},  # ragged
            {"pixels": [["a"] * 8] * 8},                  # not numbers
            {"pixels": []},                               # no image
            {"image": [[0.0] * 8] * 8},                   # wrong field
        ]
        for payload in cases:
            response = await client.post("/classify", json=payload)
            assert 400 <= response.status_code < 500, (payload, response.text)
            assert response.json()["detail"], payload
        garbage = await client.post("/classify", content=b"not json", headers={"content-type": "application/json"})
        assert garbage.status_code == 422
        # The app still serves after bad requests.
        assert (await client.get("/healthz")).json()["status"] == "ok"



def test_web_app_script_serves_with_uvicorn(samples, expected_digits):
    """`python examples/web_app.py` starts a real uvicorn server on 127.0.0.1."""
    pytest.importorskip("uvicorn", reason="uvicorn is in the 'serve' extra")
    images, _ = samples
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "web_app.py"), "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start in 60 s"
            time.sleep(0.1)
        response = httpx.post(f"{url}/classify", json={"pixels": images[:4, 0].tolist()}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["predictions"] == expected_digits[:4].tolist()
    finally:
        proc.terminate()
        try:
            output = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
    assert "Application shutdown complete" in output, output  # the lifespan ran its shutdown


# -- notebook --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernel_name() -> str:
    """A Jupyter kernel for this interpreter: the installed python3 spec, else one made for the test."""
    from jupyter_client.kernelspec import find_kernel_specs

    if "python3" not in find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user", "--name", "python3"],
                       check=True, capture_output=True, timeout=120)
    return "python3"


def test_notebook_is_stored_without_outputs():
    import nbformat

    nb = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)
    assert any("await " in cell.source for cell in code)  # it shows top-level await


def test_notebook_runs_in_a_kernel(kernel_name):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name=kernel_name, startup_timeout=120,
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    accuracy_lines = [line for line in text.splitlines() if line.startswith("accuracy:")]
    assert accuracy_lines, text
    assert float(accuracy_lines[0].split()[1]) > 0.9  # the embedded model is ~98% accurate
    assert "callback: success = True" in text
    assert "disposed" in text

    # The latency, profile and intermediate-output cells each draw a figure, shown inline as a PNG.
    plot_cells = [cell for cell in nb.cells if cell.cell_type == "code" and "plt.show()" in cell.source]
    assert len(plot_cells) >= 3, "the notebook lost its plots"
    for cell in plot_cells:
        images = [out for out in cell.outputs
                  if out.output_type == "display_data" and "image/png" in out.get("data", {})]
        assert images, f"no image/png output from the cell starting {cell.source.splitlines()[0]!r}"
        assert all(len(out.data["image/png"]) > 1000 for out in images)  # base64 of a real figure
    assert re.search(r"^100 runs: p50 \d+\.\d+ ms, p99 \d+\.\d+ ms$", text, flags=re.M), text
    assert "op type" in text and "Conv+Relu" in text                       # the profile's summary
    assert "relu1: (4, 16, 8, 8)" in text and "pool: (4, 32, 4, 4)" in text  # intermediate outputs


# -- trio ------------------------------------------------------------------------------------------

def test_trio_example_runs():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "trio_example.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("trio readback: accuracy") for line in lines), proc.stdout
    assert sum(line.startswith("trio nursery run") for line in lines) == 4, proc.stdout
    assert "trio callback: success = True" in lines, proc.stdout
    assert any(line.startswith("trio callback digits:") for line in lines), proc.stdout
