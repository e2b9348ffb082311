"""Serving throughput and latency: 64 concurrent clients sending batch-1 requests, in one process.

Three ways to serve the same requests, on one asyncio loop, in alternating rounds:

(a) ``batched``: asyncinfer's ``DynamicBatcher`` (concurrent requests merged along axis 0);
(b) ``unbatched``: ``await worker.run(x)`` per request (concurrent runs on the CPU pool);
(c) ``ort_threads``: ONNX Runtime's ``session.run`` through ``loop.run_in_executor`` on a thread
    pool with one thread per client (the usual way to call a blocking engine from asyncio).

Every client sends its next request as soon as the previous one is answered. Reported per mode:
throughput (requests/s over the rounds), p50/p99 latency per request, and for (a) how many
requests each engine run carried. Outputs are checked against ORT before anything is timed.

    python3 bench/serving.py [--models digits squeezenet] [--clients 64] [--requests 2048] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
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
from asyncinfer import assets
from asyncinfer.serving import DynamicBatcher
from bench import common

MODES = ("batched", "unbatched", "ort_threads")
# Requests per round: the small digits CNN needs many to last long enough to time; squeezenet few.
DEFAULT_REQUESTS = {"digits": 2048, "squeezenet": 192}

# Recorded with the results: OpenBLAS's own threads change the batched figures a lot (see README).
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")

Call = Callable[[], Awaitable[Any]]


def model_and_input(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model and one batch-1 request: the embedded digits CNN, or a light model-zoo model."""
    if name == "digits":
        proto = onnx.load(str(assets.default_model_path()))
        return proto, {"image": assets.default_samples()[0][:1]}
    proto = common.load_light_model(name)
    return proto, common.standard_inputs(proto, batch=1)


async def drive(call: Call, clients: int, requests: int) -> tuple[float, list[float]]:
    """``clients`` concurrent loops sharing ``requests`` calls; returns (elapsed s, latencies s)."""
    latencies: list[float] = []
    remaining = requests

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, latencies


async def measure_model_async(proto: onnx.ModelProto, inputs: dict[str, np.ndarray], *, clients: int = 64,
                              requests: int = 2048, rounds: int = 3, max_batch_size: int = 32,
                              max_delay: float = 0.002, max_concurrent_batches: int = 2,
                              threads: int | None = None) -> dict[str, Any]:
    """Throughput and latency of the three modes on one model (see the module docstring)."""
    threads = threads or common.default_threads()
    model = ai.load_model(proto)
    session = common.ort_session(proto, threads)
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=clients, thread_name_prefix="ort-client") as pool:
        async with ai.Worker(model, "cpu", threads=threads) as worker:
            async with DynamicBatcher(worker, max_batch_size=max_batch_size, max_delay=max_delay,
                                      max_concurrent_batches=max_concurrent_batches) as batcher:
                calls: dict[str, Call] = {
                    "batched": lambda: batcher.infer(inputs),
                    "unbatched": lambda: worker.run(inputs),
                    "ort_threads": lambda: loop.run_in_executor(pool, session.run, None, inputs),
                }
                expected = common.ort_outputs(session, inputs)
                max_diff = common.check_outputs_match(await batcher.infer(inputs), expected)
                await worker.warmup(inputs)  # (and its choice of serial or parallel runs made: runtime/tuning.py)
                common.check_outputs_match(await worker.run(inputs), expected)
                for name in MODES:  # warm-up: thread pools started, first-run work done
                    await drive(calls[name], clients, clients)
                elapsed = {name: 0.0 for name in MODES}
                latencies: dict[str, list[float]] = {name: [] for name in MODES}
                runs_before, requests_before = batcher.stats.engine_runs, batcher.stats.requests
                for round_ in range(rounds):
                    shift = round_ % len(MODES)  # rotate the order: no mode always follows the same one
                    for name in MODES[shift:] + MODES[:shift]:
                        await asyncio.sleep(common.SETTLE_S)
                        seconds, samples = await drive(calls[name], clients, requests)
                        elapsed[name] += seconds
                        latencies[name] += samples
                engine_runs = batcher.stats.engine_runs - runs_before
                batched_requests = batcher.stats.requests - requests_before
    result: dict[str, Any] = {"threads": threads, "clients": clients, "requests_per_round": requests,
                              "rounds": rounds, "max_batch_size": max_batch_size, "max_delay_ms": max_delay * 1e3,
                              "max_concurrent_batches": max_concurrent_batches,
                              "max_abs_diff": max_diff, "modes": {}}
    for name in MODES:
        result["modes"][name] = {"throughput_rps": len(latencies[name]) / elapsed[name],
                                 **common.percentiles_ms(latencies[name])}
    result["modes"]["batched"]["requests_per_engine_run"] = batched_requests / max(engine_runs, 1)
    ort_rps = result["modes"]["ort_threads"]["throughput_rps"]
    for name in MODES:
        result["modes"][name]["throughput_vs_ort"] = result["modes"][name]["throughput_rps"] / ort_rps
    return result


def run(models: Sequence[str] = ("digits", "squeezenet"), *, clients: int = 64, requests: int | None = None,
        rounds: int = 3, max_batch_size: int = 32, max_delay: float = 0.002, max_concurrent_batches: int = 2,
        threads: int | None = None, verbose: bool = True) -> dict[str, Any]:
    """Measure every model; one that cannot load or mismatches ORT is recorded as an error."""
    def measure(name: str) -> dict[str, Any]:
        proto, inputs = model_and_input(name)
        return asyncio.run(measure_model_async(
            proto, inputs, clients=clients, requests=requests or DEFAULT_REQUESTS.get(name, 256),
            rounds=rounds, max_batch_size=max_batch_size, max_delay=max_delay,
            max_concurrent_batches=max_concurrent_batches, threads=threads))

    per_model = common.measure_each(models, "serving", measure, verbose)
    return {"clients": clients, "rounds": rounds, "blas_threads_env": {k: os.environ.get(k) for k in BLAS_ENV},
            "models": per_model}


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for name, r in result["models"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        for mode, m in r["modes"].items():
            per_run = m.get("requests_per_engine_run")
            rows.append([f"{name} {mode}", m["throughput_rps"], m["throughput_vs_ort"], m["p50_ms"], m["p99_ms"],
                         m["max_ms"], "" if per_run is None else per_run, ""])
    common.print_table(["model / mode", "req/s", "vs ORT", "p50 ms", "p99 ms", "max ms", "req/run", "note"], rows,
                       title=f"Serving, {result['clients']} concurrent clients, batch-1 requests, "
                             f"{result['rounds']} rounds per mode")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The --quick profile: 16 clients, one short round per mode.
QUICK: dict[str, Any] = {"clients": 16, "requests": 64, "rounds": 1}


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None (DynamicBatcher needs no server extras)."""
    return common.missing_modules("onnxruntime")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Throughput of each asyncinfer mode as a multiple of ORT's (higher is better), per model."""
    return {f"{name} {mode} req/s ×ORT": common.dig(r, "modes", mode, "throughput_vs_ort")
            for name, r in result["models"].items() for mode in ("batched", "unbatched")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["digits", "squeezenet"],
                        help="'digits' (the embedded CNN) and/or light model-zoo names (default: digits squeezenet)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"requests per mode and round (default: {DEFAULT_REQUESTS}, else 256)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode, alternating (default 3)")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--max-concurrent-batches", type=int, default=2)
    common.add_engine_args(parser, "serving.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    result = run(args.models, clients=args.clients, requests=args.requests, rounds=args.rounds,
                 max_batch_size=args.max_batch_size, max_delay=args.max_delay_ms / 1e3,
                 max_concurrent_batches=args.max_concurrent_batches, threads=args.threads)
    return common.report("serving", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
