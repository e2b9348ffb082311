"""Each conv of a model inside its run, asyncinfer against ONNX Runtime: where a model's gap is.

One-node benchmarks (`bench/conv_shapes.py`) time a conv hot, alone; inside a model its input,
output and weights come from wherever the layers before left them (after a ResNet-50 run's 100 MB
of weights, from memory), and the ratio can be twice as large. Here both engines run the whole
model: asyncinfer's steps are timed by `Worker.profile`, ONNX Runtime's nodes by its own profiler
(``enable_profiling``: it adds a few µs a node, nothing against these convs of 0.1-3 ms; a
profiled ResNet-50 run took 50.1 ms against 51.1 unprofiled). The convs are paired in graph order
(both engines keep one conv a Conv node, with its activation and a residual Add fused or not),
and printed worst first with each side's GFLOP/s::

    python3 bench/conv_layers.py resnet50                 # a light-zoo model, 2 threads
    python3 bench/conv_layers.py resnet18 --threads 1     # a real architecture (bench/architectures.py)

Not a test and not part of ``python -m bench``: a tool to choose the next kernel to work on
(docs/benchmarks.md, forty-eighth session).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import onnx

import asyncinfer as ai
from bench import architectures, common

CONV_KINDS = ("Conv", "ResidualConv")


def _model(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    if name in architectures.ARCHITECTURES:
        return onnx.load(str(architectures.model_path(name))), architectures.ARCHITECTURES[name].inputs()
    proto = common.load_light_model(name)
    return proto, common.standard_inputs(proto, batch=1)


def ort_conv_times(proto: onnx.ModelProto, inputs: dict[str, np.ndarray], threads: int, runs: int) -> list[float]:
    """ONNX Runtime's median µs of each Conv node (its fused ones included), in the order it first ran them."""
    import onnxruntime as ort  # noqa: PLC0415 - an optional bench dependency

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.enable_profiling, options.log_severity_level = True, 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for _ in range(runs + 10):
        session.run(None, inputs)
    events = json.loads(Path(session.end_profiling()).read_text())
    order: list[str] = []
    times: dict[str, list[float]] = collections.defaultdict(list)
    for event in events:
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.endswith("_kernel_time") and event["args"].get("op_name") == "Conv":
            node = name.removesuffix("_kernel_time")
            if node not in times:
                order.append(node)
            times[node].append(event["dur"])
    return [statistics.median(times[node][-runs:]) for node in order]


def our_conv_times(proto: onnx.ModelProto, inputs: dict[str, np.ndarray], threads: int,
                   runs: int) -> list[dict[str, Any]]:
    """asyncinfer's conv steps in graph order: kind, weight shape, stride, output shape, median µs."""
    model = ai.load_model(proto)
    with ai.Worker(model, "cpu", threads=threads) as worker:
        worker.warmup_blocking(inputs)
        with worker.profile() as profile:
            for _ in range(runs):
                worker.run_blocking(inputs)
    layers = {layer.name: layer for layer in model.layers}
    steps: dict[str, list[float]] = collections.defaultdict(list)
    shapes = {}
    for record in profile.records:
        if layers[record.layer].op_type in CONV_KINDS:
            steps[record.layer].append(record.duration_ns / 1e3)
            shapes[record.layer] = record.output_shapes[0]
    rows = []
    for name, times in steps.items():  # (records come in run order: the first run's order is the graph's)
        layer = layers[name]
        rows.append({"kind": layer.kind, "weight": model.constants[layer.inputs[1]].shape,
                     "stride": layer.attrs.get("strides", [1, 1])[0], "out": shapes[name],
                     "us": statistics.median(times)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a light-zoo name or a real architecture (bench/architectures.py)")
    parser.add_argument("--threads", type=int, default=common.default_threads())
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    reason = common.missing_modules("onnxruntime")
    if reason:
        return common.cannot_run(__file__, reason)
    proto, inputs = _model(args.model)
    ours = our_conv_times(proto, inputs, args.threads, args.runs)
    theirs = ort_conv_times(proto, inputs, args.threads, args.runs)
    if len(ours) != len(theirs):
        print(f"cannot pair the convs: {len(ours)} asyncinfer conv steps, {len(theirs)} ONNX Runtime Conv nodes")
        return 1
    rows = []
    for i, (step, ort_us) in enumerate(zip(ours, theirs)):
        m, c, kh, kw = step["weight"]
        out = step["out"]
        flops = 2 * m * c * kh * kw * out[0] * out[2] * out[3]
        rows.append((step["us"] - ort_us, i, f"{step['kind']} {c}->{m} {kh}x{kw}/{step['stride']} @{out[2]}x{out[3]}",
                     step["us"], flops / step["us"] / 1e3, ort_us, flops / ort_us / 1e3))
    rows.sort(reverse=True)
    common.print_table(["#", "conv", "asyncinfer µs", "GFLOP/s", "ORT µs", "GFLOP/s", "µs behind"],
                       [(i, name, f"{us:.0f}", f"{gf:.0f}", f"{ort:.0f}", f"{ort_gf:.0f}", f"{gap:.0f}")
                        for gap, i, name, us, gf, ort, ort_gf in rows],
                       title=f"{args.model}: its convs in the run, {args.threads} threads, median of {args.runs}")
    print(f"sum: asyncinfer {sum(r[3] for r in rows) / 1e3:.2f} ms, ONNX Runtime {sum(r[5] for r in rows) / 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
