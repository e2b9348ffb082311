"""Concurrent throughput and event-loop lag: N asyncio tasks sharing one model, asyncinfer vs ORT.

N tasks (default 8) on one asyncio loop each run the same batch-1 request over and over, for a
fixed time, two ways in alternating blocks:

- ``asyncinfer``: one ``ai.Worker(model, "cpu", threads=T)`` shared by all tasks, each looping
  ``await worker.run(inputs)``;
- ``ort``: one ``InferenceSession`` (``intra_op_num_threads=T``) shared by all tasks, each looping
  ``await loop.run_in_executor(pool, session.run, None, inputs)`` on a ``ThreadPoolExecutor(N)``:
  what a new user would write.

Throughput: after ``seconds`` no task starts a new run; every run started is counted, over the
time from the block's start to the last one's end (no partial run is lost or counted twice).
Each round runs one block of each engine back to back (the order alternating), and the ratio
asyncinfer/ORT (above 1: asyncinfer serves more) is the median of the rounds' ratios: the
machines these run on change speed by 10-20% from one minute to the next, and two blocks side by
side see the same phase where the medians of each engine's blocks did not (two rounds of 5 s
gave 0.84-0.91 for the same code in one morning). Meanwhile a 1 ms ``asyncio.sleep`` ticker on
the same loop records how late it wakes up (p50/p99/max over each engine's blocks). For
context, the single-request latency of each engine (``await``, nothing else running). Outputs
are checked against ORT first. The timed blocks run with the heap frozen (`common.frozen_heap`),
as a latency-minded application runs once its models are loaded: a full garbage collection
would stall the loop 20-60 ms.

    python3 bench/concurrency.py [--models squeezenet resnet50] [--tasks 8] [--seconds 2.5] [--rounds 4]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import onnx

import asyncinfer as ai
from bench import common
from bench.overhead import _ticker  # the 1 ms ticker of overhead's loop-lag measurement

ENGINES = ("asyncinfer", "ort")
TICK_S = 0.001

Call = Callable[[], Awaitable[Any]]


async def drive(call: Call, tasks: int, seconds: float) -> tuple[int, float, list[float]]:
    """``tasks`` loops of ``await call()`` for ``seconds``, with the ticker alongside.

    Returns (runs completed, seconds from start to the last run's end, ticker lateness in s).
    """
    stop = asyncio.Event()
    lags: list[float] = []

    async def client() -> int:
        runs = 0
        while not stop.is_set():
            await call()
            runs += 1
        return runs

    ticker = asyncio.create_task(_ticker(stop, TICK_S, lags))
    start = time.perf_counter()
    clients = [asyncio.create_task(client()) for _ in range(tasks)]
    await asyncio.sleep(seconds)
    stop.set()
    runs = sum(await asyncio.gather(*clients))  # the runs in flight finish and count
    elapsed = time.perf_counter() - start
    await ticker
    return runs, elapsed, lags


async def measure_model_async(proto: onnx.ModelProto, inputs: dict[str, np.ndarray], *, tasks: int = 8,
                              seconds: float = 2.5, rounds: int = 4, repeats: int = 8,
                              threads: int | None = None) -> dict[str, Any]:
    """Throughput and loop lag of both engines under ``tasks`` concurrent tasks (module docstring)."""
    threads = threads or common.default_threads()
    session = common.ort_session(proto, threads)
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=tasks, thread_name_prefix="ort-task") as pool:
        async with ai.Worker(ai.load_model(proto), "cpu", threads=threads) as worker:
            calls: dict[str, Call] = {
                "asyncinfer": lambda: worker.run(inputs),
                "ort": lambda: loop.run_in_executor(pool, session.run, None, inputs),
            }
            max_diff = common.check_outputs_match(await worker.run(inputs), common.ort_outputs(session, inputs))
            await worker.warmup(inputs)  # (and its choice of serial or parallel runs made: runtime/tuning.py)
            latency = await common.time_interleaved_async(calls, repeats=repeats, warmup=1)
            for name in ENGINES:  # warm-up: every executor thread started, first concurrent runs done
                await asyncio.gather(*(calls[name]() for _ in range(tasks)))
            rps: dict[str, list[float]] = {name: [] for name in ENGINES}
            lags: dict[str, list[float]] = {name: [] for name in ENGINES}
            with common.frozen_heap():
                for round_ in range(rounds):
                    shift = round_ % len(ENGINES)  # rotate the order: neither engine always goes first
                    for name in ENGINES[shift:] + ENGINES[:shift]:
                        await asyncio.sleep(common.SETTLE_S)  # the other engine's threads settle
                        runs, elapsed, block_lags = await drive(calls[name], tasks, seconds)
                        rps[name].append(runs / elapsed)
                        lags[name] += block_lags
    engines = {name: {"runs_per_s": statistics.median(rps[name]), "runs_per_s_blocks": rps[name],
                      "single_request": latency[name].to_dict(),
                      "loop_lag": {"ticks": len(lags[name]), **common.percentiles_ms(lags[name], (50, 99))}}
               for name in ENGINES}
    round_ratios = [ours / theirs for ours, theirs in zip(rps["asyncinfer"], rps["ort"])]
    return {"threads": threads, "tasks": tasks, "seconds": seconds, "rounds": rounds, "max_abs_diff": max_diff,
            "engines": engines, "round_ratios": round_ratios, "ratio": statistics.median(round_ratios)}


def run(models: Sequence[str] = ("squeezenet", "resnet50"), *, tasks: int = 8, seconds: float = 2.5,
        rounds: int = 4, repeats: int = 8, threads: int | None = None, verbose: bool = True) -> dict[str, Any]:
    """Measure every light model named; one that cannot load or mismatches ORT is recorded as an error."""
    def measure(name: str) -> dict[str, Any]:
        proto = common.load_light_model(name)
        return asyncio.run(measure_model_async(proto, common.standard_inputs(proto, batch=1), tasks=tasks,
                                               seconds=seconds, rounds=rounds, repeats=repeats, threads=threads))

    return {"tasks": tasks, "seconds": seconds, "rounds": rounds, "threads": threads or common.default_threads(),
            "models": common.measure_each(models, "concurrency", measure, verbose)}


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for name, r in result["models"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        for engine, e in r["engines"].items():
            lag = e["loop_lag"]
            rows.append([f"{name} {engine}", e["runs_per_s"], r["ratio"] if engine == "asyncinfer" else "",
                         e["single_request"]["median_ms"], lag["p50_ms"], lag["p99_ms"], lag["max_ms"], ""])
    common.print_table(["model / engine", "runs/s", "×ORT", "1-req ms", "lag p50 ms", "lag p99 ms", "lag max ms",
                        "note"], rows,
                       title=f"{result['tasks']} concurrent tasks, batch 1, {result['threads']} threads, "
                             f"{result['rounds']} rounds of a {result['seconds']:g} s block per engine (median "
                             f"runs/s; ×ORT: median of the rounds' ratios); loop lag of a 1 ms ticker meanwhile")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The --quick profile: squeezenet, one 1 s block per engine.
QUICK: dict[str, Any] = {"models": ("squeezenet",), "seconds": 1.0, "rounds": 1, "repeats": 3}


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    return common.missing_modules("onnxruntime")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Per model: throughput as a multiple of ORT's (higher is better), asyncinfer's loop lag p99 and max."""
    figures: dict[str, float | None] = {}
    for name, r in result["models"].items():
        figures[f"{name} {result['tasks']}-task runs/s ×ORT"] = common.dig(r, "ratio")
        for stat in ("p99", "max"):
            figures[f"{name} loop-lag {stat} ms"] = common.dig(r, "engines", "asyncinfer", "loop_lag", f"{stat}_ms")
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["squeezenet", "resnet50"],
                        help="light model-zoo names (default: squeezenet resnet50)")
    parser.add_argument("--tasks", type=int, default=8, help="concurrent asyncio tasks (default 8)")
    parser.add_argument("--seconds", type=float, default=2.5, help="length of each block (default 2.5)")
    parser.add_argument("--rounds", type=int, default=4, help="blocks per engine, alternating (default 4)")
    parser.add_argument("--repeats", type=int, default=8, help="timed single requests per engine (default 8)")
    common.add_engine_args(parser, "concurrency.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    result = run(args.models, tasks=args.tasks, seconds=args.seconds, rounds=args.rounds, repeats=args.repeats,
                 threads=args.threads)
    return common.report("concurrency", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
