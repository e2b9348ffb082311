"""Single-Conv micro-benchmark on the real layer shapes of mobile and classic CNNs, against ORT.

Each row is a one-node model (Conv with bias, plus the activation the real network puts after it
when asyncinfer's optimizer fuses it into the Conv: Relu, HardSwish), run through
``ai.Worker(model, "cpu").run_blocking`` and through an ONNX Runtime session on the same input,
interleaved (see ``common.time_interleaved``). Outputs are checked against ORT first.

Columns: asyncinfer µs (whole ``run_blocking``), the Conv kernel alone (``op`` µs: the kernel
called directly, without the worker), ORT µs, and the ratio asyncinfer / ORT.

    python3 bench/conv_shapes.py                 # every shape, batch 1, plus MobileNetV3 at batch 32
    python3 bench/conv_shapes.py --filter ' dw '  # rows whose name matches this regular expression
    python3 bench/conv_shapes.py --repeats 30 --no-batch32 --json out.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from asyncinfer import ops
from asyncinfer.model.ir import Layer
from bench import common


@dataclass(frozen=True)
class Shape:
    """One Conv layer: ``cin``→``cout`` channels on a ``size``×``size`` input map."""

    net: str
    cin: int
    cout: int
    size: int
    k: int
    stride: int = 1
    group: int = 1
    pad: int | None = None  # None: (k - 1) // 2, torchvision's "same"-style padding
    act: str | None = None  # activation fused into the Conv by asyncinfer's optimizer

    @property
    def pads(self) -> int:
        return (self.k - 1) // 2 if self.pad is None else self.pad

    def name(self, batch: int) -> str:
        kind = "dw" if self.group == self.cin and self.group > 1 else ("pw" if self.k == 1 else "conv")
        chans = f"{self.cin}ch" if kind == "dw" else f"{self.cin}->{self.cout}"
        act = f"+{self.act}" if self.act else ""
        return f"{self.net} {kind} {self.k}x{self.k}s{self.stride} {chans}@{self.size} b{batch}{act}"


def _mbv3(*args: Any, **kw: Any) -> Shape:
    return Shape("mbv3s", *args, **kw)


def _effb0(*args: Any, **kw: Any) -> Shape:
    return Shape("effb0", *args, **kw)


def _dw(net: str, c: int, size: int, k: int, stride: int, act: str | None = None) -> Shape:
    return Shape(net, c, c, size, k, stride, group=c, act=act)


# torchvision mobilenet_v3_small (see bench/architectures.py): stem, then per block
# expand 1x1 (+act) → depthwise (+act) → project 1x1 (no act).
MOBILENET_V3_SMALL = [
    _mbv3(3, 16, 224, 3, 2, act="HardSwish"),                    # stem
    _dw("mbv3s", 16, 112, 3, 2, "Relu"), _mbv3(16, 16, 56, 1),    # block 1 (no expand)
    _mbv3(16, 72, 56, 1, act="Relu"), _dw("mbv3s", 72, 56, 3, 2, "Relu"), _mbv3(72, 24, 28, 1),
    _mbv3(24, 88, 28, 1, act="Relu"), _dw("mbv3s", 88, 28, 3, 1, "Relu"), _mbv3(88, 24, 28, 1),
    _mbv3(24, 96, 28, 1, act="HardSwish"), _dw("mbv3s", 96, 28, 5, 2, "HardSwish"), _mbv3(96, 40, 14, 1),
    _mbv3(40, 240, 14, 1, act="HardSwish"), _dw("mbv3s", 240, 14, 5, 1, "HardSwish"), _mbv3(240, 40, 14, 1),
    _dw("mbv3s", 288, 14, 5, 2, "HardSwish"), _mbv3(288, 96, 7, 1),
    _mbv3(96, 576, 7, 1, act="HardSwish"), _dw("mbv3s", 576, 7, 5, 1, "HardSwish"), _mbv3(576, 96, 7, 1),
]

# torchvision efficientnet_b0: SiLU is Sigmoid*x there, which does not fuse: bias only.
EFFICIENTNET_B0 = [
    _effb0(3, 32, 224, 3, 2),                                           # stem
    _dw("effb0", 32, 112, 3, 1), _effb0(32, 16, 112, 1),                 # stage 1
    _effb0(16, 96, 112, 1), _dw("effb0", 96, 112, 3, 2), _effb0(96, 24, 56, 1),
    _dw("effb0", 144, 56, 3, 1), _dw("effb0", 144, 56, 5, 2), _effb0(144, 40, 28, 1),
    _dw("effb0", 240, 28, 5, 1), _dw("effb0", 240, 28, 3, 2),
    _effb0(80, 480, 14, 1), _dw("effb0", 480, 14, 3, 1), _dw("effb0", 480, 14, 5, 1),
    _dw("effb0", 672, 14, 5, 1), _dw("effb0", 672, 14, 5, 2),
    _dw("effb0", 1152, 7, 5, 1), _effb0(1152, 320, 7, 1),
]

CONVNEXT_T = [
    Shape("convnext", 3, 96, 224, 4, 4, pad=0),                         # stem 4x4/4
    _dw("convnext", 96, 56, 7, 1), _dw("convnext", 192, 28, 7, 1), _dw("convnext", 384, 14, 7, 1),
    _dw("convnext", 768, 7, 7, 1),
    Shape("convnext", 96, 192, 56, 2, 2, pad=0),                        # downsample 2x2/2
]

RESNET18 = [
    Shape("resnet18", 3, 64, 224, 7, 2, act="Relu"),                    # stem
    Shape("resnet18", 64, 64, 56, 3, 1, act="Relu"),
    Shape("resnet18", 64, 128, 56, 3, 2, act="Relu"),
    Shape("resnet18", 128, 128, 28, 3, 1, act="Relu"),
    Shape("resnet18", 256, 256, 14, 3, 1, act="Relu"),
    Shape("resnet18", 512, 512, 7, 3, 1, act="Relu"),
    Shape("resnet18", 64, 128, 56, 1, 2),                               # downsample shortcut
]

ALL_SHAPES = MOBILENET_V3_SMALL + EFFICIENTNET_B0 + CONVNEXT_T + RESNET18


def conv_model(shape: Shape, batch: int, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A one-Conv model (weights and bias as initializers, then ``shape.act``) and its input."""
    rng = np.random.default_rng(seed)
    fan_in = shape.cin // shape.group * shape.k * shape.k
    w = (rng.standard_normal((shape.cout, shape.cin // shape.group, shape.k, shape.k)) / np.sqrt(fan_in))
    b = rng.standard_normal(shape.cout) * 0.1
    x = rng.standard_normal((batch, shape.cin, shape.size, shape.size)).astype(np.float32)
    p = shape.pads
    conv_out = "y" if shape.act is None else "conv"
    nodes = [helper.make_node("Conv", ["x", "w", "b"], [conv_out], kernel_shape=[shape.k, shape.k],
                              strides=[shape.stride] * 2, pads=[p] * 4, group=shape.group)]
    if shape.act is not None:
        nodes.append(helper.make_node(shape.act, [conv_out], ["y"]))
    graph = helper.make_graph(
        nodes, "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w.astype(np.float32), "w"), numpy_helper.from_array(b.astype(np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), {"x": x}


def _op_runner(proto: onnx.ModelProto, x: np.ndarray) -> Any:
    """The Conv kernel alone, called directly (no worker, no activation)."""
    node = proto.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    layer = Layer("conv", "Conv", list(node.input), ["y"], attrs=attrs, version=17)
    op = ops.create(layer)
    w, b = (numpy_helper.to_array(t) for t in proto.graph.initializer)
    return lambda: op(x, w, b)


def measure(shape: Shape, batch: int, repeats: int, threads: int) -> dict[str, Any]:
    proto, inputs = conv_model(shape, batch)
    session = common.ort_session(proto, threads)
    with ai.Worker(ai.load_model(proto), "cpu", threads=threads) as worker:
        common.check_outputs_match(worker.run_blocking(inputs), common.ort_outputs(session, inputs),
                                   rtol=1e-3, atol=1e-4)
        worker.warmup_blocking(inputs)  # the run mode decided, as a served model's would be
        run_ort = common.ort_runner(session, inputs)
        timings = common.time_interleaved({
            "asyncinfer": lambda: worker.run_blocking(inputs),
            "op": _op_runner(proto, inputs["x"]),
            "ort": run_ort,
        }, repeats=repeats)
    us = {k: t.median_ms * 1e3 for k, t in timings.items()}
    return {"asyncinfer_us": us["asyncinfer"], "op_us": us["op"], "ort_us": us["ort"],
            "ratio": us["asyncinfer"] / us["ort"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=common.default_threads())
    parser.add_argument("--filter", default="", help="only rows whose name matches this regular expression")
    parser.add_argument("--no-batch32", action="store_true", help="skip the MobileNetV3 batch-32 rows")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    cases = [(s, 1) for s in ALL_SHAPES]
    if not args.no_batch32:
        cases += [(s, 32) for s in MOBILENET_V3_SMALL]
    rows, results = [], {}
    start = time.perf_counter()
    for shape, batch in cases:
        name = shape.name(batch)
        if not re.search(args.filter, name):
            continue
        r = measure(shape, batch, args.repeats, args.threads)
        results[name] = r
        rows.append((name, r["asyncinfer_us"], r["op_us"], r["ort_us"], r["ratio"]))
        print(f"{name:45s} {r['asyncinfer_us']:9.0f} {r['op_us']:9.0f} {r['ort_us']:9.0f} {r['ratio']:6.2f}",
              flush=True)
    common.print_table(["shape", "asyncinfer µs", "op µs", "ORT µs", "ratio"], rows,
                       title=f"Conv shapes, {args.threads} threads, median of {args.repeats}")
    ratios = [r[4] for r in rows]
    if ratios:
        print(f"geomean ratio {common.geomean(ratios):.2f}, worst {max(ratios):.2f}; "
              f"{time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"environment": common.environment(), "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
