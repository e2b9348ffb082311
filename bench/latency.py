"""CPU batch-1 latency of asyncinfer vs ONNX Runtime on the light model zoo.

For each model both engines run in this process, interleaved round by round: asyncinfer through
``await worker.run(x)`` (on one asyncio loop) and through ``worker.run_blocking(x)``, and ORT
through ``session.run``. Outputs are checked against ORT before anything is timed.

    python3 bench/latency.py [--models resnet50 squeezenet] [--repeats 20] [--threads N]
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

import numpy as np
import onnx

import asyncinfer as ai
from bench import common

CONTESTANTS = ("asyncinfer_await", "asyncinfer_blocking", "ort")


async def measure_latency_async(proto: onnx.ModelProto, inputs: dict[str, np.ndarray], *, repeats: int = 20,
                                warmup: int = 2, threads: int | None = None) -> dict[str, Any]:
    """Latency of one model: timings per contestant (ms), ratios to ORT, output agreement.

    Raises OutputMismatch if asyncinfer's outputs differ from ORT's (then nothing is timed), and
    whatever ``load_model`` raises (e.g. UnsupportedOperatorError).
    """
    threads = threads or common.default_threads()
    model = ai.load_model(proto)
    session = common.ort_session(proto, threads)
    with ai.Worker(model, "cpu", threads=threads) as worker:
        expected = common.ort_outputs(session, inputs)
        max_diff = common.check_outputs_match(await worker.run(inputs), expected)
        common.check_outputs_match(worker.run_blocking(inputs), expected)
        await worker.warmup(inputs)  # (and its choice of serial or parallel runs made: runtime/tuning.py)
        timings = await common.time_interleaved_async({
            "asyncinfer_await": lambda: worker.run(inputs),
            "asyncinfer_blocking": lambda: worker.run_blocking(inputs),
            "ort": common.ort_runner(session, inputs),
        }, repeats=repeats, warmup=warmup)
    ort_ms = timings["ort"].median_ms
    return {
        "threads": threads,
        "layers": len(model.layers),
        "max_abs_diff": max_diff,
        "timings": {name: t.to_dict() for name, t in timings.items()},
        "ratio_await": timings["asyncinfer_await"].median_ms / ort_ms,
        "ratio_blocking": timings["asyncinfer_blocking"].median_ms / ort_ms,
        # best over best: on a shared machine noise only ever adds time, so the minima are the
        # steadiest estimate of each engine's own cost (the medians are what users feel)
        "ratio_best": timings["asyncinfer_await"].min_ms / timings["ort"].min_ms,
    }


def measure_light_model(name: str, *, repeats: int = 20, warmup: int = 2,
                        threads: int | None = None) -> dict[str, Any]:
    """:func:`measure_latency_async` on ``light_<name>.onnx`` with its standard input."""
    proto = common.load_light_model(name)
    inputs = common.standard_inputs(proto)
    return asyncio.run(measure_latency_async(proto, inputs, repeats=repeats, warmup=warmup, threads=threads))


def run(models: Sequence[str] = common.LIGHT_MODELS, *, repeats: int = 20, warmup: int = 2,
        threads: int | None = None, verbose: bool = True) -> dict[str, Any]:
    """Measure every model; a model that fails to load or mismatches is recorded as an error."""
    per_model = common.measure_each(
        models, "latency", lambda name: measure_light_model(name, repeats=repeats, warmup=warmup, threads=threads),
        verbose)
    measured = [r for r in per_model.values() if "error" not in r]
    return {
        "repeats": repeats,
        "threads": threads or common.default_threads(),
        "models": per_model,
        "geomean_ratio_await": common.geomean(r["ratio_await"] for r in measured),
        "geomean_ratio_blocking": common.geomean(r["ratio_blocking"] for r in measured),
        "geomean_ratio_best": common.geomean(r["ratio_best"] for r in measured),
        "measured": len(measured),
    }


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for name, r in result["models"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        t = r["timings"]
        rows.append([name, t["asyncinfer_await"]["median_ms"], t["asyncinfer_blocking"]["median_ms"],
                     t["ort"]["median_ms"], r["ratio_await"], r["ratio_blocking"], r["ratio_best"],
                     f"p10-p90 ort {t['ort']['p10_ms']:.1f}-{t['ort']['p90_ms']:.1f}"])
    rows.append(["geomean", "", "", "", result["geomean_ratio_await"], result["geomean_ratio_blocking"],
                 result["geomean_ratio_best"], ""])
    common.print_table(["model", "await ms", "blocking ms", "ORT ms", "await/ORT", "blocking/ORT", "best/best", "note"],
                       rows,
                       title=f"CPU batch-1 latency, median of {result['repeats']} interleaved runs, "
                             f"{result['threads']} threads each")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The --quick profile: every model, a few repeats (a smoke run, not a measurement).
QUICK: dict[str, Any] = {"repeats": 3, "warmup": 1}


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    return common.missing_modules("onnxruntime")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Geometric means over the models of asyncinfer/ORT median latency (lower is better)."""
    return {"await/ORT": result["geomean_ratio_await"], "blocking/ORT": result["geomean_ratio_blocking"],
            "best/best": result["geomean_ratio_best"], "models": result["measured"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(common.LIGHT_MODELS),
                        help=f"light models to run (default: {' '.join(common.LIGHT_MODELS)})")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per engine and model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per engine first")
    common.add_engine_args(parser, "latency.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    result = run(args.models, repeats=args.repeats, warmup=args.warmup, threads=args.threads)
    return common.report("latency", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
