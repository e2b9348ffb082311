"""GPU latency of asyncinfer's gpu_compute backend vs ONNX Runtime's CUDAExecutionProvider.

Light resnet50, densenet121 and inception_v2 at batch 1 and 32 (the batch-32 models are the
same graphs with their batch dimension, and the constant batch of their final Reshape, set to 32).
Both engines run in this process, interleaved in blocks (see ``bench/common.py``), end to end:
host arrays in, host arrays out, so both pay their uploads and readbacks. asyncinfer is timed
through ``await worker.run(x)`` (one asyncio loop) and ``worker.run_blocking(x)``. Outputs are
checked against ORT (CUDA, else CPU) before anything is timed. Without ORT's CUDA provider the
asyncinfer numbers are still reported, and the report says why there is no ratio.

Needs CuPy and a CUDA device; without them it stops at once, saying what is missing.

    python3 bench/gpu_compute.py [--models resnet50 densenet121] [--batches 1 32] [--repeats 30] [--no-cudnn]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import onnx
from onnx import numpy_helper

import asyncinfer as ai
from bench import common

MODELS: tuple[str, ...] = ("resnet50", "densenet121", "inception_v2")
BATCHES: tuple[int, ...] = (1, 32)
CONTESTANTS = ("asyncinfer_await", "asyncinfer_blocking", "ort_cuda")


# -- models -----------------------------------------------------------------------------------------
def batched_light_model(name: str, batch: int) -> onnx.ModelProto:
    """``light_<name>.onnx`` with batch ``batch``: input/output batch dims and the leading 1 of the
    constant shapes fed to Reshape (the light models flatten to ``[1, C]``) become ``batch``."""
    proto = common.load_light_model(name)
    if batch == 1:
        return proto
    for value in list(common.graph_inputs(proto)) + list(proto.graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_value = batch
    del proto.graph.value_info[:]  # recomputed by shape inference at load
    shape_inputs = {node.input[1] for node in proto.graph.node if node.op_type == "Reshape" and len(node.input) > 1}
    for k, init in enumerate(proto.graph.initializer):
        if init.name in shape_inputs:
            shape = numpy_helper.to_array(init).copy()
            if shape.size and shape[0] == 1:
                shape[0] = batch
                proto.graph.initializer[k].CopyFrom(numpy_helper.from_array(shape, init.name))
    return proto


# -- ONNX Runtime on CUDA -----------------------------------------------------------------------------
def ort_cuda_session(proto: onnx.ModelProto) -> tuple[Any | None, str]:
    """An ORT session on CUDAExecutionProvider (TF32 off, like CuPy's default float32 GEMMs), or
    ``(None, why not)``."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None, "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return None, (f"ORT's CUDAExecutionProvider is not available (providers: {ort.get_available_providers()}; "
                      "install onnxruntime-gpu)")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    errors = []
    for provider_options in ({"use_tf32": "0"}, {}):  # older ORT has no use_tf32 option
        try:
            session = ort.InferenceSession(proto.SerializeToString(), options,
                                           providers=[("CUDAExecutionProvider", provider_options)])
        except Exception as exc:  # noqa: BLE001 - e.g. missing CUDA/cuDNN libraries for ORT
            errors.append(common.error_text(exc))
            continue
        if session.get_providers()[0] == "CUDAExecutionProvider":
            return session, ""
        errors.append(f"ORT fell back to {session.get_providers()}")
    return None, "ORT could not create a CUDA session: " + "; ".join(errors)


# -- measurement -------------------------------------------------------------------------------------
async def measure_async(proto: onnx.ModelProto, inputs: dict[str, np.ndarray], *, repeats: int,
                        warmup: int) -> dict[str, Any]:
    """Timings of one model at one batch size: asyncinfer gpu_compute (await and blocking) and, when
    it is available, ORT CUDA; ratios asyncinfer/ORT. Raises OutputMismatch on disagreement."""
    model = ai.load_model(proto)
    session, ort_note = ort_cuda_session(proto)
    reference = session if session is not None else common.ort_session(proto)
    expected = common.ort_outputs(reference, inputs)
    with ai.Worker(model, "gpu_compute") as worker:
        placement = worker.placement
        max_diff = common.check_outputs_match(await worker.run(inputs), expected, rtol=1e-3, atol=1e-4)
        common.check_outputs_match(worker.run_blocking(inputs), expected, rtol=1e-3, atol=1e-4)
        contestants = {"asyncinfer_await": lambda: worker.run(inputs),
                       "asyncinfer_blocking": lambda: worker.run_blocking(inputs)}
        if session is not None:
            contestants["ort_cuda"] = common.ort_runner(session, inputs)
        timings = await common.time_interleaved_async(contestants, repeats=repeats, warmup=warmup)
        device = worker._backend.description
        cudnn = worker._backend._ctx.conv is not None
    result: dict[str, Any] = {
        "device": device,
        "cudnn": cudnn,
        "layers": len(model.layers),
        "fallback_layers": len(placement.fallback),
        "transfers": placement.transfers,
        "max_abs_diff": max_diff,
        "reference": "ort_cuda" if session is not None else "ort_cpu",
        "timings": {name: t.to_dict() for name, t in timings.items()},
    }
    if session is None:
        result["note"] = ort_note
        return result
    ort_ms = timings["ort_cuda"].median_ms
    result["ratio_await"] = timings["asyncinfer_await"].median_ms / ort_ms
    result["ratio_blocking"] = timings["asyncinfer_blocking"].median_ms / ort_ms
    result["ratio_best"] = timings["asyncinfer_await"].min_ms / timings["ort_cuda"].min_ms
    return result


def run(models: Sequence[str] = MODELS, batches: Sequence[int] = BATCHES, *, repeats: int = 30, warmup: int = 3,
        verbose: bool = True) -> dict[str, Any]:
    """Measure every (model, batch); one that fails to load or mismatches is recorded as an error."""
    keys = [f"{name}@{batch}" for name in models for batch in batches]

    def measure(key: str) -> dict[str, Any]:
        name, batch = key.split("@")
        proto = batched_light_model(name, int(batch))
        inputs = common.standard_inputs(proto, int(batch))
        return asyncio.run(measure_async(proto, inputs, repeats=repeats, warmup=warmup))

    per_model = common.measure_each(keys, "gpu_compute", measure, verbose)
    rated = [r for r in per_model.values() if "ratio_await" in r]
    return {
        "repeats": repeats,
        "models": per_model,
        "geomean_ratio_await": common.geomean(r["ratio_await"] for r in rated),
        "geomean_ratio_blocking": common.geomean(r["ratio_blocking"] for r in rated),
        "geomean_ratio_best": common.geomean(r["ratio_best"] for r in rated),
        "measured": len([r for r in per_model.values() if "error" not in r]),
        "rated": len(rated),
    }


def print_report(result: dict[str, Any]) -> None:
    rows, notes, device = [], set(), "?"
    for key, r in result["models"].items():
        if "error" in r:
            rows.append([key, "-", "-", "-", "-", "-", "-", r["error"][:70]])
            continue
        device = f"{r['device']}, cuDNN {'on' if r['cudnn'] else 'off'}"
        t = r["timings"]
        ort = t.get("ort_cuda")
        fallback = f"{r['fallback_layers']} fallback layers" if r["fallback_layers"] else ""
        rows.append([key, t["asyncinfer_await"]["median_ms"], t["asyncinfer_blocking"]["median_ms"],
                     "-" if ort is None else ort["median_ms"], r.get("ratio_await", "-"), r.get("ratio_blocking", "-"),
                     r.get("ratio_best", "-"), fallback])
        if "note" in r:
            notes.add(r["note"])
    rows.append(["geomean", "", "", "", result["geomean_ratio_await"], result["geomean_ratio_blocking"],
                 result["geomean_ratio_best"], ""])
    common.print_table(["model@batch", "await ms", "blocking ms", "ORT CUDA ms", "await/ORT", "blocking/ORT",
                        "best/best", "note"], rows,
                       title=f"GPU latency (host in, host out), median of {result['repeats']} interleaved runs; "
                             f"{device}")
    for note in sorted(notes):
        print(f"no ORT ratio: {note}")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The --quick profile: a few repeats (the warm-up stays: it compiles the kernels).
QUICK: dict[str, Any] = {"repeats": 3}


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here (no CuPy, no CUDA device), or None."""
    return common.missing_modules("onnxruntime") or common.backend_unavailable_reason("gpu_compute")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Geometric means over (model, batch) of asyncinfer/ORT-CUDA median latency (lower is better)."""
    return {"await/ORT CUDA": result["geomean_ratio_await"], "blocking/ORT CUDA": result["geomean_ratio_blocking"],
            "best/best": result["geomean_ratio_best"], "rated": result["rated"], "measured": result["measured"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"light models (default: {' '.join(MODELS)})")
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES), help="batch sizes (default: 1 32)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per engine, model and batch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per engine first (kernel compilation)")
    parser.add_argument("--no-cudnn", action="store_true", help="convolutions through im2col + cuBLAS, not cuDNN")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/results/gpu_compute.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    if args.no_cudnn:
        os.environ["ASYNCINFER_CUDNN"] = "0"
    result = run(args.models, args.batches, repeats=args.repeats, warmup=args.warmup)
    return common.report("gpu_compute", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
