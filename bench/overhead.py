"""Scheduling overheads of asyncinfer, with ONNX Runtime as the yardstick where it applies.

(a) per-layer overhead: a chain of N tiny ``Add`` layers; time per run / N = cost per layer.
(b) ``schedule()`` time: how long ``worker.schedule(x)`` itself takes, against the full run.
(c) event-loop lag: how late a 1 ms ticker wakes up while a model runs through ``await worker.run``,
    and with nothing running (the baseline: the loop's own timer granularity).
(d) fixed cost of a run: one run of a one-``Add`` model, from the call to the result in hand
    (``await worker.run``, ``run_blocking``, ORT's ``session.run``): what a streaming model called
    every few milliseconds pays besides its layers.

    python3 bench/overhead.py [--layers 1000] [--repeats 30] [--lag-seconds 3] [--model resnet50]
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import onnx
from onnx import TensorProto, helper

import asyncinfer as ai
from bench import common


# -- the Add chain ----------------------------------------------------------------------------------
def add_chain_model(layers: int, width: int = 4) -> onnx.ModelProto:
    """``y = x + c + c + ... + c`` as ``layers`` separate Add layers.

    ``c`` is a second graph *input*, not an initializer, so no constant folding or
    Add-of-constants merging in either engine can shorten the chain: every layer must run.
    """
    if layers < 1:
        raise ValueError("layers must be >= 1")
    nodes = []
    prev = "x"
    for i in range(layers):
        out = "y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("Add", [prev, "c"], [out], name=f"add{i}"))
        prev = out
    graph = helper.make_graph(
        nodes, f"add_chain_{layers}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [width]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, [width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [width])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def add_chain_inputs(width: int = 4) -> dict[str, np.ndarray]:
    return {"x": common.standard_input([width]), "c": np.full([width], 0.5, dtype=np.float32)}


def _check_chain(outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray], layers: int) -> None:
    """The chain must have computed x + layers*c (so no layer was skipped)."""
    want = inputs["x"] + layers * inputs["c"]
    if not np.allclose(outputs["y"], want, rtol=1e-4):
        raise common.OutputMismatch(f"add chain: got {outputs['y']}, want {want}")


async def measure_per_layer_async(layers: int = 1000, *, repeats: int = 30, warmup: int = 2,
                                  threads: int | None = None, width: int = 4) -> dict[str, Any]:
    """(a) Cost per layer of a chain of tiny Adds, in µs, for asyncinfer (await and blocking) and ORT."""
    threads = threads or common.default_threads()
    proto = add_chain_model(layers, width)
    inputs = add_chain_inputs(width)
    model = ai.load_model(proto)
    session = common.ort_session(proto, threads)
    with ai.Worker(model, "cpu", threads=threads) as worker:
        _check_chain(await worker.run(inputs), inputs, layers)
        await worker.warmup(inputs)  # (and its choice of serial or parallel runs made: runtime/tuning.py)
        _check_chain(common.ort_outputs(session, inputs), inputs, layers)
        timings = await common.time_interleaved_async({
            "asyncinfer_await": lambda: worker.run(inputs),
            "asyncinfer_blocking": lambda: worker.run_blocking(inputs),
            "ort": common.ort_runner(session, inputs),
        }, repeats=repeats, warmup=warmup)
    us_per_layer = {name: t.median_ms * 1e3 / layers for name, t in timings.items()}
    return {
        "layers": layers,
        "asyncinfer_layers_after_optimize": len(model.layers),
        "width": width,
        "threads": threads,
        "timings": {name: t.to_dict() for name, t in timings.items()},
        "us_per_layer": us_per_layer,
    }


def measure_per_layer(layers: int = 1000, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(measure_per_layer_async(layers, **kwargs))


# -- schedule() time --------------------------------------------------------------------------------
def _wait_all(execution: ai.Execution, model: ai.Model) -> None:
    for info in model.outputs:
        execution.peek_output(info.name).download_to_array()


def measure_schedule(proto: onnx.ModelProto, inputs: dict[str, np.ndarray], *, repeats: int = 30,
                     warmup: int = 2, threads: int | None = None) -> dict[str, Any]:
    """(b) Time of ``worker.schedule(x)`` alone vs schedule-to-last-output, measured in the same runs.

    Each run is waited for before the next starts, so runs never overlap. On the CPU backend the
    first layers already execute while schedule() walks the rest, so its time includes GIL
    contention with them: that is the cost a caller sees.
    """
    model = ai.load_model(proto)
    schedule_s: list[float] = []
    run_s: list[float] = []
    with ai.Worker(model, "cpu", threads=threads) as worker:
        worker.warmup_blocking(inputs)  # (and its choice of serial or parallel runs made: runtime/tuning.py)
        for i in range(warmup + repeats):
            start = time.perf_counter()
            execution = worker.schedule(inputs)
            scheduled = time.perf_counter()
            _wait_all(execution, model)
            done = time.perf_counter()
            if i >= warmup:
                schedule_s.append(scheduled - start)
                run_s.append(done - start)
    schedule_t = common.Timing.from_seconds(schedule_s)
    run_t = common.Timing.from_seconds(run_s)
    return {
        "layers": len(model.layers),
        "schedule": schedule_t.to_dict(),
        "run": run_t.to_dict(),
        "schedule_us_per_layer": schedule_t.median_ms * 1e3 / max(1, len(model.layers)),
        "ratio": schedule_t.median_ms / run_t.median_ms,
    }


# -- event-loop lag ---------------------------------------------------------------------------------
async def _ticker(stop: asyncio.Event, period: float, lags: list[float]) -> None:
    """Sleep ``period`` over and over, recording how late each wake-up is (seconds)."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(max(0.0, time.perf_counter() - start - period))


async def _load(worker: ai.Worker, inputs: dict[str, np.ndarray], stop: asyncio.Event) -> int:
    runs = 0
    while not stop.is_set():
        await worker.run(inputs)
        runs += 1
    return runs


async def measure_loop_lag_async(worker: ai.Worker | None, inputs: dict[str, np.ndarray] | None = None, *,
                                 seconds: float = 3.0, period: float = 0.001) -> dict[str, Any]:
    """(c) Lateness of a ``period`` ticker over ``seconds``, while ``worker`` runs back to back.

    ``worker=None`` measures the ticker alone (the baseline).
    """
    stop = asyncio.Event()
    lags: list[float] = []
    ticker = asyncio.create_task(_ticker(stop, period, lags))
    load = asyncio.create_task(_load(worker, inputs or {}, stop)) if worker is not None else None
    await asyncio.sleep(seconds)
    stop.set()
    await ticker
    runs = await load if load is not None else 0  # the last run finishes before we return
    return {"seconds": seconds, "period_ms": period * 1e3, "ticks": len(lags), "model_runs": runs,
            **common.percentiles_ms(lags, (50, 99))}


def measure_loop_lag(proto: onnx.ModelProto | None, inputs: dict[str, np.ndarray] | None = None, *,
                     seconds: float = 3.0, period: float = 0.001,
                     threads: int | None = None) -> dict[str, Any]:
    """:func:`measure_loop_lag_async` with a fresh worker for ``proto`` (None: baseline, no model)."""
    if proto is None:
        return asyncio.run(measure_loop_lag_async(None, seconds=seconds, period=period))
    model = ai.load_model(proto)
    with ai.Worker(model, "cpu", threads=threads) as worker:
        worker.warmup_blocking(inputs)  # outside the measured window (the run mode chosen too)
        return asyncio.run(measure_loop_lag_async(worker, inputs, seconds=seconds, period=period))


# -- driver ----------------------------------------------------------------------------------------
def _guarded(label: str, fn: Any, *args: Any, verbose: bool = True, **kwargs: Any) -> dict[str, Any]:
    """Run one measurement; a model that cannot load becomes an ``error`` entry, not a crash."""
    if verbose:
        print(f"overhead: {label} ...", flush=True)
    try:
        return fn(*args, **kwargs)
    except (ai.AsyncInferError, common.OutputMismatch, FileNotFoundError) as exc:
        if verbose:
            print(f"  skipped: {common.error_text(exc)}", flush=True)
        return {"error": common.error_text(exc)}


def run(*, layers: int = 1000, repeats: int = 30, lag_seconds: float = 3.0, model: str = "resnet50",
        threads: int | None = None, verbose: bool = True) -> dict[str, Any]:
    """All three measurements; ``model`` is the light model used for (b) and (c)."""
    chain_name = f"add_chain_{layers}"
    chain, chain_inputs = add_chain_model(layers), add_chain_inputs()
    light = common.load_light_model(model)  # a wrong name is the caller's mistake: let it raise
    light_inputs = common.standard_inputs(light)
    guarded = functools.partial(_guarded, verbose=verbose)
    per_layer = guarded(f"per-layer, {layers} Adds", measure_per_layer, layers, repeats=repeats, threads=threads)
    schedule = {
        chain_name: guarded(f"schedule(), {layers} Adds", measure_schedule, chain, chain_inputs,
                            repeats=repeats, threads=threads),
        model: guarded(f"schedule(), {model}", measure_schedule, light, light_inputs,
                       repeats=repeats, threads=threads),
    }
    fixed = guarded("fixed cost, one Add", measure_per_layer, 1, repeats=3 * repeats, threads=threads)
    loop_lag = {
        "baseline": guarded("loop lag, no model", measure_loop_lag, None, seconds=lag_seconds),
        model: guarded(f"loop lag, {model}", measure_loop_lag, light, light_inputs,
                       seconds=lag_seconds, threads=threads),
    }
    return {"per_layer": per_layer, "schedule": schedule, "loop_lag": loop_lag, "fixed_cost": fixed, "model": model,
            "chain": chain_name, "threads": threads or common.default_threads()}


def print_report(result: dict[str, Any]) -> None:
    pl = result["per_layer"]
    if "error" in pl:
        print(f"\nper-layer overhead: skipped ({pl['error']})")
    else:
        rows = [[name, pl["timings"][name]["median_ms"], pl["us_per_layer"][name]] for name in pl["timings"]]
        common.print_table(["engine", "run ms", "µs/layer"], rows,
                           title=f"(a) per-layer overhead: chain of {pl['layers']} Add layers, shape [{pl['width']}]")
    rows = []
    for name, r in result["schedule"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", r["error"][:60]])
        else:
            rows.append([name, r["layers"], r["schedule"]["median_ms"], r["run"]["median_ms"], r["ratio"],
                         f"{r['schedule_us_per_layer']:.1f} µs/layer"])
    common.print_table(["model", "layers", "schedule ms", "run ms", "schedule/run", "note"], rows,
                       title="(b) worker.schedule(x) time vs full run (medians)")
    rows = []
    for name, r in result["loop_lag"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", "-", r["error"][:60]])
        else:
            rows.append([name, r["ticks"], r["model_runs"], r["p50_ms"], r["p99_ms"], r["max_ms"], ""])
    common.print_table(["load", "ticks", "model runs", "p50 ms", "p99 ms", "max ms", "note"], rows,
                       title="(c) event-loop lag of a 1 ms asyncio.sleep ticker")
    fixed = result.get("fixed_cost") or {"error": "not measured"}
    if "error" in fixed:
        print(f"\n(d) fixed cost of a run: skipped ({fixed['error']})")
    else:
        rows = [[name, t["median_ms"] * 1e3, t["p90_ms"] * 1e3] for name, t in fixed["timings"].items()]
        common.print_table(["engine", "µs a run", "p90 µs"], rows,
                           title="(d) fixed cost: one run of a one-Add model, call to result in hand")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The --quick profile: a few repeats and half-second loop-lag windows.
QUICK: dict[str, Any] = {"repeats": 5, "lag_seconds": 0.5}


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    return common.missing_modules("onnxruntime")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Per-layer cost asyncinfer/ORT, and the absolute overheads the floors are about."""
    await_us = common.dig(result, "per_layer", "us_per_layer", "asyncinfer_await")
    ort_us = common.dig(result, "per_layer", "us_per_layer", "ort")
    model = result["model"]
    return {"per-layer await/ORT": await_us / ort_us if await_us and ort_us else None,
            "µs/layer await": await_us,
            "fixed µs, await": fixed_us(result, "asyncinfer_await"),
            f"loop-lag p99 ms ({model})": common.dig(result, "loop_lag", model, "p99_ms"),
            "loop-lag p99 ms (no model)": common.dig(result, "loop_lag", "baseline", "p99_ms"),
            f"schedule/run ({model})": common.dig(result, "schedule", model, "ratio")}


def fixed_us(result: dict[str, Any], engine: str) -> float | None:
    """(d)'s median µs a run for ``engine`` (None when it was not measured)."""
    ms = common.dig(result, "fixed_cost", "timings", engine, "median_ms")
    return None if ms is None else ms * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=1000, help="length of the Add chain")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per measurement")
    parser.add_argument("--lag-seconds", type=float, default=3.0, help="duration of each loop-lag window")
    parser.add_argument("--model", default="resnet50", help="light model for schedule() and loop lag")
    common.add_engine_args(parser, "overhead.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    result = run(layers=args.layers, repeats=args.repeats, lag_seconds=args.lag_seconds, model=args.model,
                 threads=args.threads)
    return common.report("overhead", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
