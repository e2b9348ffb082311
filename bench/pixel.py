"""gpu_pixel batch-1 latency against the CPU backend and ONNX Runtime on the light model zoo.

All three run in this process, in alternating blocks (see ``common.time_interleaved_async``),
each through its usual entry: ``await worker.run(x)`` for both asyncinfer backends and
``session.run`` for ORT. Outputs are checked against ORT before anything is timed. The report
also says how many layers fell back to the CPU and how many transfers a run costs, and which GL
renderer ran the shaders (Mesa's llvmpipe renders on the CPU cores).

    python3 bench/pixel.py [--models squeezenet resnet50] [--repeats 5] [--threads N]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnx

import asyncinfer as ai
from bench import common


async def measure_async(proto: onnx.ModelProto, inputs: dict, *, repeats: int, warmup: int,
                        threads: int | None) -> dict[str, Any]:
    """Timings of gpu_pixel, cpu and ORT on one model (ms), their ratios and the placement."""
    threads = threads or common.default_threads()
    model = ai.load_model(proto)
    session = common.ort_session(proto, threads)
    expected = common.ort_outputs(session, inputs)
    with ai.Worker(model, "gpu_pixel", threads=threads) as pixel, ai.Worker(model, "cpu", threads=threads) as cpu:
        max_diff = common.check_outputs_match(await pixel.run(inputs), expected, rtol=1e-3, atol=1e-4)
        common.check_outputs_match(await cpu.run(inputs), expected)
        timings = await common.time_interleaved_async({
            "gpu_pixel": lambda: pixel.run(inputs),
            "cpu": lambda: cpu.run(inputs),
            "ort": common.ort_runner(session, inputs),
        }, repeats=repeats, warmup=warmup, block=2)
        placement = pixel.placement
        renderer = pixel._backend.gpu.renderer
    return {
        "threads": threads,
        "renderer": renderer,
        "layers": len(placement.layers),
        "fallback_layers": len(placement.fallback),
        "transfers": placement.transfers,
        "max_abs_diff": max_diff,
        "timings": {name: t.to_dict() for name, t in timings.items()},
        "ratio_pixel_cpu": timings["gpu_pixel"].median_ms / timings["cpu"].median_ms,
        "ratio_pixel_ort": timings["gpu_pixel"].median_ms / timings["ort"].median_ms,
    }


def run(models: Sequence[str] = common.LIGHT_MODELS, *, repeats: int = 5, warmup: int = 1,
        threads: int | None = None, verbose: bool = True) -> dict[str, Any]:
    """Measure every model; one that fails to load or mismatches is recorded as an error."""

    def measure(name: str) -> dict[str, Any]:
        proto = common.load_light_model(name)
        inputs = common.standard_inputs(proto)
        return asyncio.run(measure_async(proto, inputs, repeats=repeats, warmup=warmup, threads=threads))

    per_model = common.measure_each(models, "pixel", measure, verbose)
    measured = [r for r in per_model.values() if "error" not in r]
    return {
        "repeats": repeats,
        "threads": threads or common.default_threads(),
        "renderer": measured[0]["renderer"] if measured else "?",
        "models": per_model,
        "geomean_pixel_cpu": common.geomean(r["ratio_pixel_cpu"] for r in measured),
        "geomean_pixel_ort": common.geomean(r["ratio_pixel_ort"] for r in measured),
        "measured": len(measured),
    }


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for name, r in result["models"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        t = r["timings"]
        rows.append([name, t["gpu_pixel"]["median_ms"], t["cpu"]["median_ms"], t["ort"]["median_ms"],
                     r["ratio_pixel_cpu"], r["ratio_pixel_ort"], f"{r['fallback_layers']}/{r['layers']}",
                     r["transfers"]])
    rows.append(["geomean", "", "", "", result["geomean_pixel_cpu"], result["geomean_pixel_ort"], "", ""])
    common.print_table(["model", "pixel ms", "cpu ms", "ORT ms", "pixel/cpu", "pixel/ORT", "fallback", "transfers"],
                       rows,
                       title=f"gpu_pixel batch-1 latency on {result['renderer']}, median of {result['repeats']} "
                             f"interleaved runs, {result['threads']} threads for the CPU engines")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The --quick profile: squeezenet only, once (Mesa's llvmpipe makes every pixel run costly on a CPU).
QUICK: dict[str, Any] = {"models": ["squeezenet"], "repeats": 1, "warmup": 0}


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here (no onnxruntime, no EGL/OpenGL 3.3 context), or None."""
    return common.missing_modules("onnxruntime") or common.backend_unavailable_reason("gpu_pixel")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Geometric means over the models of gpu_pixel median latency over ORT's and the CPU backend's."""
    return {"pixel/ORT": result["geomean_pixel_ort"], "pixel/cpu": result["geomean_pixel_cpu"],
            "models": result["measured"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(common.LIGHT_MODELS),
                        help=f"light models to run (default: {' '.join(common.LIGHT_MODELS)})")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per engine and model")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per engine first")
    common.add_engine_args(parser, "pixel.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    result = run(args.models, repeats=args.repeats, warmup=args.warmup, threads=args.threads)
    return common.report("pixel", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
