"""Scale-out on Ray Serve: throughput of 1 replica against N, the same protocol, the same client.

A local Ray cluster (one node, the machine's cores) serves an MLP (``x [N, width]`` through
``layers`` MatMul+Relu layers sharing one ``width x width`` weight) with
``asyncinfer.serving.ray.deployment``. The CPU time of Ray's HTTP proxy, the replicas and the
client is reported per block: on a small machine they share the cores.
Each replica runs the model on one thread (``threads=1``, one CPU reserved): the model is
single-threaded per replica, so throughput can only grow by adding replicas. Variants:

- ``asyncinfer``: the replicas' own dynamic batcher (the deployment's default);
- ``unbatched``: ``batching=False``: every request runs alone;
- ``serve_batch``: a minimal replica that decodes and encodes with asyncinfer's protocol module
  but batches with Ray Serve's ``@serve.batch`` instead (no admission, statistics or metrics:
  it is the lighter of the two paths), to compare the two batchers.

Before anything is timed, every variant answers one request and its output must match
``onnx.reference``. The load is the local client of bench/serving_load.py (one keep-alive
connection per in-flight request, binary tensors) on the same cores as the cluster, so the
figures on a small machine include the client's and Ray's proxy's CPU. Ray's workers run at nice
0 here (``RAY_worker_niceness``; Ray's default is 15) so they compete on equal terms with the client. Replica counts take turns
(rounds) so drift on a shared machine hits them alike.

    python3 bench/serving_ray.py [--replicas 1 2] [--variants asyncinfer unbatched serve_batch]
        [--concurrency 8] [--seconds 8] [--warmup 2] [--rounds 2] [--rows 8] [--layers 256]
        [--width 512] [--no-write]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench import common

try:  # the serve_batch variant's FastAPI handler resolves its annotations from this module
    from fastapi import Request, Response
except ImportError:  # reported by main(): the bench needs the ray extra (and fastapi, a dev dependency)
    Request = Response = None  # type: ignore[assignment,misc]

VARIANTS = {
    "asyncinfer": "asyncinfer.serving.ray.deployment, the replicas' dynamic batcher",
    "unbatched": "the same with batching=False",
    "serve_batch": "asyncinfer's protocol decoding, Ray Serve's @serve.batch instead of the dynamic batcher",
}
APP = "bench"
MAX_ROWS = 256  # rows per merged run, for both batchers
MAX_DELAY = 0.002  # seconds a request may wait for batch-mates, for both batchers


def mlp_model(width: int, layers: int, seed: int = 0) -> onnx.ModelProto:
    """``x [N, width]`` -> ``layers`` x (MatMul ``width x width``, Relu) -> ``y [N, width]``. The layers
    share one weight matrix: much compute for little memory, and small requests (a few rows) still cost
    tens of ms, so the bench measures the replicas rather than moving request bodies."""
    rng = np.random.default_rng(seed)
    # orthogonal: the activations keep their scale through hundreds of layers
    weight, _ = np.linalg.qr(rng.standard_normal((width, width)))
    weights = [numpy_helper.from_array(weight.astype(np.float32), "w")]
    nodes, last = [], "x"
    for i in range(layers):
        out = "y" if i == layers - 1 else f"h{i}"
        nodes += [helper.make_node("MatMul", [last, "w"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [out])]
        last = out
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def serve_batch_app(path: str, replicas: int, rows: int) -> Any:
    """The ``serve_batch`` variant: KServe v2 infer only, batched by ``@serve.batch``."""
    from fastapi import FastAPI
    from ray import serve

    api = FastAPI()

    class ServeBatchReplica:
        def __init__(self, model_path: str):
            import asyncinfer as ai

            self.model = ai.load_model(model_path)
            self.worker = ai.Worker(self.model, "cpu", threads=1)

        @api.post("/v2/models/{name}/infer")
        async def infer(self, name: str, request: Request) -> Response:
            from asyncinfer.serving.protocol import encode_infer_response, parse_infer_request

            parsed = parse_infer_request(await request.body(), request.headers.get("inference-header-content-length"),
                                         self.model, name)
            y = await self.run_batch(parsed.inputs["x"])
            content, headers = encode_infer_response(name, "1", parsed, {"y": y})
            return Response(content, headers=headers)

        @serve.batch(max_batch_size=max(1, MAX_ROWS // rows), batch_wait_timeout_s=MAX_DELAY)  # counts requests
        async def run_batch(self, xs: list[np.ndarray]) -> list[np.ndarray]:
            y = (await self.worker.run(np.concatenate(xs)))["y"]
            return np.split(y, np.cumsum([len(x) for x in xs])[:-1])

    # Annotations as objects, not strings: the class is pickled by value, without this module's globals.
    ServeBatchReplica.infer.__annotations__.update(name=str, request=Request, **{"return": Response})
    wrapped = serve.ingress(api)(ServeBatchReplica)
    return serve.deployment(wrapped, name="serve_batch", num_replicas=replicas, max_ongoing_requests=256,
                            ray_actor_options={"num_cpus": 1}).bind(path)


def application(variant: str, path: str, replicas: int, rows: int) -> Any:
    from asyncinfer.serving.ray import deployment

    if variant == "serve_batch":
        return serve_batch_app(path, replicas, rows)
    return deployment({"mlp": path}, replicas=replicas, threads=1, cpus_per_replica=1,
                      batching=variant == "asyncinfer", max_batch_size=MAX_ROWS, max_delay=MAX_DELAY)


def check_answer(port: int, x: np.ndarray, expected: np.ndarray) -> float:
    """One request; the largest absolute difference from ``onnx.reference`` (raises when off)."""
    from bench.serving_baseline import HEADER_LENGTH, decode_response, encode_request
    from bench.serving_load import http

    body, headers = encode_request({"x": x})
    status, answer_headers, answer = http("POST", f"http://127.0.0.1:{port}/v2/models/mlp/infer", body, headers)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {answer[:200]!r}")
    y = decode_response(answer, answer_headers.get(HEADER_LENGTH.lower()))["y"]
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    return float(np.abs(y - expected).max())


def ray_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process's Ray descendants: the HTTP proxy, the replicas, the rest."""
    import psutil

    spent = {"proxy": 0.0, "replicas": 0.0, "other_ray": 0.0}
    for child in psutil.Process().children(recursive=True):
        try:
            name, times = " ".join(child.cmdline()[:1]), child.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        kind = "proxy" if "ProxyActor" in name else "replicas" if "ServeReplica" in name else "other_ray"
        spent[kind] += times.user + times.system
    return spent


async def block(port: int, x: np.ndarray, concurrency: int, seconds: float) -> Any:
    from bench.serving_load import Connection, drive, raw_request

    conns = [Connection(port, raw_request(port, "mlp", {"x": x})) for _ in range(concurrency)]
    try:
        return await drive(conns, seconds)
    finally:
        for conn in conns:
            conn.close()


def run(replica_counts: Sequence[int] = (1, 2), variants: Sequence[str] = tuple(VARIANTS), *, concurrency: int = 8,
        seconds: float = 8.0, warmup: float = 2.0, rounds: int = 2, rows: int = 8, layers: int = 256,
        width: int = 512) -> dict[str, Any]:
    import ray
    from onnx.reference import ReferenceEvaluator
    from ray import serve

    from asyncinfer.serving.ray import proxy
    from bench.serving_load import free_port

    cores = os.cpu_count() or 1
    if max(replica_counts) > cores:
        raise ValueError(f"{max(replica_counts)} replicas of one CPU each do not fit {cores} cores")
    model = mlp_model(width, layers)
    x = np.random.default_rng(1).standard_normal((rows, width)).astype(np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    folder = tempfile.mkdtemp(prefix="serving-ray-")
    path = os.path.join(folder, "mlp.onnx")
    onnx.save(model, path)
    os.environ.setdefault(proxy.ENV_VAR, proxy.IMPORT_PATH)
    # Ray starts its workers (replicas, proxy) at nice 15 by default; on a machine shared with the load
    # generator (and anything else), that would measure the scheduler, not the replicas.
    os.environ.setdefault("RAY_worker_niceness", "0")
    port = free_port()
    load_before = os.getloadavg()[0]
    ray.init(num_cpus=cores, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False)
    throughput: dict[str, dict[int, list[float]]] = {v: {n: [] for n in replica_counts} for v in variants}
    used: dict[str, dict[int, list[dict[str, float]]]] = {v: {n: [] for n in replica_counts} for v in variants}
    errors: dict[str, int] = {v: 0 for v in variants}
    max_error: dict[str, float] = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for round_ in range(rounds):
            order = list(replica_counts) if round_ % 2 == 0 else list(reversed(replica_counts))
            for variant in variants:
                for replicas in order:
                    serve.run(application(variant, path, replicas, rows), name=APP, route_prefix="/")
                    max_error[variant] = check_answer(port, x, expected)
                    asyncio.run(block(port, x, concurrency, warmup))
                    before, client0 = ray_cpu_seconds(), time.process_time()
                    result = asyncio.run(block(port, x, concurrency, seconds))
                    after, client = ray_cpu_seconds(), time.process_time() - client0
                    share = {k: (after[k] - before[k]) / result.elapsed_s for k in after}
                    share["client"] = client / result.elapsed_s
                    throughput[variant][replicas].append(result.ok / result.elapsed_s)
                    used[variant][replicas].append(share)
                    errors[variant] += result.errors
                    print(f"round {round_ + 1} {variant:>11} {replicas} replica(s): "
                          f"{result.ok / result.elapsed_s:8.1f} infer/s ({result.errors} errors); cores: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in share.items()), file=sys.stderr)
                    serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    base = min(replica_counts)
    results: dict[str, Any] = {
        "setup": {"cores": cores, "concurrency": concurrency, "seconds": seconds, "rounds": rounds, "rows": rows,
                  "layers": layers, "width": width, "mflop_per_request": 2 * rows * width * width * layers / 1e6,
                  "threads_per_replica": 1, "cpus_per_replica": 1,
                  # runnable threads on the machine (1-minute average) before and after: above the core
                  # count, other work took CPU from the measured one
                  "load_average": [load_before, os.getloadavg()[0]]},
        "variants": {},
    }
    for variant in variants:
        medians = {n: statistics.median(values) for n, values in throughput[variant].items()}
        results["variants"][variant] = {
            "description": VARIANTS[variant],
            "infer_per_s": {str(n): medians[n] for n in replica_counts},
            "all_blocks": {str(n): throughput[variant][n] for n in replica_counts},
            "cores_used": {str(n): {k: statistics.median(c[k] for c in used[variant][n]) for k in used[variant][n][0]}
                           for n in replica_counts},
            "scaling": {f"{n}_vs_{base}": medians[n] / medians[base] for n in replica_counts if n != base},
            # what the replicas did with the CPU they got: flat across replica counts when only the
            # cores (not the proxy, routing or batching) limit throughput
            "infer_per_replica_core_s": {str(n): statistics.median(
                t / c["replicas"] for t, c in zip(throughput[variant][n], used[variant][n]) if c["replicas"] > 0)
                for n in replica_counts},
            "errors": errors[variant],
            "max_abs_error_vs_reference": max_error.get(variant),
        }
    return results


def print_report(result: dict[str, Any]) -> None:
    setup = result["setup"]
    print(f"\nMLP {setup['layers']} x {setup['width']}, {setup['rows']} rows per request "
          f"({setup['mflop_per_request']:.0f} MFLOP), one thread per replica, {setup['cores']} cores, "
          f"{setup['concurrency']} requests in flight; median of {setup['rounds']} blocks of {setup['seconds']} s; "
          f"load average {setup['load_average'][0]:.1f} before, {setup['load_average'][1]:.1f} after")
    for variant, figures in result["variants"].items():
        rates = ", ".join(f"{n} replica(s) {rate:.1f} infer/s" for n, rate in figures["infer_per_s"].items())
        scaling = ", ".join(f"{k.replace('_vs_', ' vs ')}: {v:.2f}x" for k, v in figures["scaling"].items())
        print(f"  {variant:>11}: {rates}; {scaling}; errors {figures['errors']}")
        for n, cores in figures["cores_used"].items():
            print(f"  {'':>11}  {n} replica(s), cores used: " + ", ".join(f"{k} {v:.2f}" for k, v in cores.items())
                  + f"; {figures['infer_per_replica_core_s'][n]:.1f} infer per replica core-second")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2], help="replica counts (default 1 2)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds per block (default 8)")
    parser.add_argument("--warmup", type=float, default=2.0, help="untimed seconds before each block (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="blocks per variant and replica count (default 2)")
    parser.add_argument("--rows", type=int, default=8, help="rows per request (default 8)")
    parser.add_argument("--layers", type=int, default=256, help="MatMul+Relu layers (default 256)")
    parser.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/results/serving_ray.json")
    args = parser.parse_args(argv)
    if (reason := common.missing_modules("ray", "fastapi")) is not None:
        return common.cannot_run(__file__, f"{reason}: pip install 'asyncinfer[ray]'")
    started = time.perf_counter()
    result = run(args.replicas, args.variants, concurrency=args.concurrency, seconds=args.seconds,
                 warmup=args.warmup, rounds=args.rounds, rows=args.rows, layers=args.layers, width=args.width)
    result["setup"]["wall_s"] = time.perf_counter() - started
    return common.report("serving_ray", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
