"""Latency beside a busy neighbour: all cores but one kept busy by another process.

A serving machine is rarely quiet: another process, a BLAS or ONNX Runtime pool spinning after
its run, a noisy tenant of the same host. Each engine runs requests of a model back to back, batch
1 (asyncinfer both blocking and awaited), alone and then with ``cores - 1`` busy loops in other processes (plain Python ``while True``,
at the default priority), in alternating blocks. Per engine: the median, p99 and worst run, and
how much slower the median is under contention (``busy / alone``). A thread pool whose callers
wait for helpers the OS does not run (asyncinfer's spin team before its parts could be taken
over: MobileNetV3-small 2.9 ms alone, 1.9 s a run with one of 2 cores busy) shows up here.

    python3 bench/contention.py [--models mobilenet_v3_small squeezenet] [--seconds 4] [--rounds 2]

A model is a light-zoo name (``bench/common.py``) or a real architecture (``bench/architectures.py``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import asyncinfer as ai
from bench import architectures, common

ENGINES = ("asyncinfer", "asyncinfer_await", "ort")
#: A busy loop of another process: what keeps a core from the engines.
_BUSY_LOOP = "while True: pass"


@contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """``count`` other processes spinning at the default priority for the block's length."""
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP]) for _ in range(count)]
    try:
        time.sleep(0.3)  # started and spinning
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _model(name: str) -> tuple[str, dict[str, np.ndarray]]:
    if name in architectures.ARCHITECTURES:
        return str(architectures.model_path(name)), architectures.ARCHITECTURES[name].inputs()
    path = common.light_model_path(name)
    return str(path), common.standard_inputs(common.load_light_model(name), batch=1)


async def _block_async(run: Callable[[], Any], seconds: float) -> list[float]:
    """Run back to back for ``seconds`` (awaiting what ``run()`` returns, if awaitable); each run's
    time in seconds (the first, untimed, settles)."""
    async def once() -> None:
        result = run()
        if asyncio.iscoroutine(result):
            await result

    await once()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        await once()
        times.append(time.perf_counter() - start)
    return times


def _stats(times: list[float]) -> dict[str, float]:
    ms = np.asarray(times) * 1e3
    return {"runs": int(ms.size), "median_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max())}


def measure_model(name: str, *, busy: int, seconds: float, rounds: int, threads: int) -> dict[str, Any]:
    """Both engines on ``name``, alone and beside ``busy`` busy cores, in alternating blocks."""
    return asyncio.run(_measure_model_async(name, busy=busy, seconds=seconds, rounds=rounds, threads=threads))


async def _measure_model_async(name: str, *, busy: int, seconds: float, rounds: int, threads: int) -> dict[str, Any]:
    path, inputs = _model(name)
    session = common.ort_session(path, threads)
    async with ai.Worker(ai.load_model(path), "cpu", threads=threads) as worker:
        common.check_outputs_match(await worker.run(inputs), common.ort_outputs(session, inputs))
        await worker.warmup(inputs)
        runs = {"asyncinfer": lambda: worker.run_blocking(inputs), "asyncinfer_await": lambda: worker.run(inputs),
                "ort": common.ort_runner(session, inputs)}
        samples: dict[tuple[str, str], list[float]] = {(e, c): [] for e in ENGINES for c in ("alone", "busy")}
        for round_ in range(rounds):
            order = ENGINES if round_ % 2 == 0 else ENGINES[::-1]
            for engine in order:
                await asyncio.sleep(common.SETTLE_S)
                samples[engine, "alone"] += await _block_async(runs[engine], seconds)
            with busy_cores(busy):
                for engine in order:
                    samples[engine, "busy"] += await _block_async(runs[engine], seconds)
    engines = {}
    for engine in ENGINES:
        alone, contended = _stats(samples[engine, "alone"]), _stats(samples[engine, "busy"])
        engines[engine] = {"alone": alone, "busy": contended,
                           "slowdown": contended["median_ms"] / alone["median_ms"]}
    ort_busy = engines["ort"]["busy"]["median_ms"]
    return {"engines": engines, "ratio_busy": engines["asyncinfer"]["busy"]["median_ms"] / ort_busy,
            "ratio_busy_await": engines["asyncinfer_await"]["busy"]["median_ms"] / ort_busy}


def run(models: Sequence[str] = ("mobilenet_v3_small", "squeezenet"), *, seconds: float = 4.0, rounds: int = 2,
        threads: int | None = None, verbose: bool = True) -> dict[str, Any]:
    """Measure every model named; one that cannot load or mismatches ORT is recorded as an error."""
    threads = threads or common.default_threads()
    busy = max(1, (os.cpu_count() or 2) - 1)
    return {"threads": threads, "busy_cores": busy, "seconds": seconds, "rounds": rounds,
            "models": common.measure_each(models, "contention", lambda name: measure_model(
                name, busy=busy, seconds=seconds, rounds=rounds, threads=threads), verbose)}


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for name, r in result["models"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        for engine, e in r["engines"].items():
            ratio = {"asyncinfer": r["ratio_busy"], "asyncinfer_await": r["ratio_busy_await"]}.get(engine, "")
            rows.append([f"{name} {engine}", e["alone"]["median_ms"], e["busy"]["median_ms"], e["busy"]["p99_ms"],
                         e["busy"]["max_ms"], e["slowdown"], ratio, ""])
    common.print_table(["model / engine", "alone ms", "busy ms", "busy p99", "busy max", "busy/alone", "ai/ORT busy",
                        "note"], rows,
                       title=f"Runs back to back, batch 1, {result['threads']} threads, alone and beside "
                             f"{result['busy_cores']} busy core(s) of other processes "
                             f"({result['rounds']} x {result['seconds']:g} s blocks each)")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
QUICK: dict[str, Any] = {"models": ("squeezenet",), "seconds": 1.0, "rounds": 1}


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if (os.cpu_count() or 1) < 2:
        return "needs 2 cores (one kept busy, one for the engines)"
    return common.missing_modules("onnxruntime")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Per model: each engine's slowdown beside busy cores, and asyncinfer/ORT when busy."""
    figures: dict[str, float | None] = {}
    for name, r in result["models"].items():
        for engine in ENGINES:
            figures[f"{name} busy/alone {engine}"] = common.dig(r, "engines", engine, "slowdown")
        figures[f"{name} busy ai/ORT"] = common.dig(r, "ratio_busy")
        figures[f"{name} busy ai await/ORT"] = common.dig(r, "ratio_busy_await")
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mobilenet_v3_small", "squeezenet"],
                        help="light-zoo or real-architecture names")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each block (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="alone/busy block pairs per engine (default 2)")
    common.add_engine_args(parser, "contention.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    result = run(args.models, seconds=args.seconds, rounds=args.rounds, threads=args.threads)
    return common.report("contention", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
