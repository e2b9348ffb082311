"""Full-size models made by ONNX Runtime's own tools: does asyncinfer load them, agree with ORT, and how fast.

Users rarely serve the bare exported graph: they quantize it with ``onnxruntime.quantization``,
fuse it with ORT's transformer optimizer, convert it to float16, or save ORT's offline-optimized
graph. This benchmark builds four full-size networks (``bench/architectures.py``, random weights),
applies each tool that fits the network, and for every resulting model: loads it in both engines,
compares outputs, and times both (interleaved blocks, as ``real_models``).

Networks: ResNet-18 and MobileNetV3-small (224x224, batch 1); BERT-base (12 layers, 768 wide, 12
heads, sequence 128, the HF export's two-Unsqueeze mask so ORT's attention fusion matches); GPT-2
small (12 layers) as one decode step with a 127-token past.

Tools (variants):

- ``fp32``: the model as built (the reference point of every ratio);
- ``dynamic``: ``quantize_dynamic`` (int8 weights, ``reduce_range``: u8 x s8 products cannot
  saturate on CPUs without VNNI);
- ``static_qop_tensor`` / ``static_qop_channel`` / ``static_qdq_tensor`` / ``static_qdq_channel``
  (CNNs): ``quantize_static`` in QOperator or QDQ format, per tensor (u8/u8) or per channel (u8/s8
  with reduce_range), calibrated on a few random images;
- ``optimizer`` (BERT, GPT-2): ``optimize_model`` with the bert / gpt2 model type (opt_level 0:
  the Python fusions; ORT's own pass needs torch), and ``optimizer_dynamic``: that, then
  ``quantize_dynamic`` (QAttention and friends);
- ``float16``: ``onnxruntime.transformers.float16.convert_float_to_float16`` (inputs and outputs
  kept float32 by ``keep_io_types``);
- ``ort_extended`` / ``ort_extended_dynamic``: the graph ORT saves with ``ORT_ENABLE_EXTENDED``
  (``optimized_model_filepath``) of the float model and of the dynamically quantized one.

Agreement, per output, as max |asyncinfer - ORT| over max |ORT|: at most 1e-3 for float32 models,
1e-2 for float16 ones. Quantized models compute in integers, where ORT's kernels round in other
ways than the ONNX definition (its DynamicQuantizeLinear, its requantization) and its u8 x s8 path
differs by CPU: one step of difference at an early layer moves every later one. ORT differs from
itself that way: on the dynamically quantized BERT-base, its outputs at ORT_DISABLE_ALL and at
ORT_ENABLE_ALL differ by 7% (pooler_output), a fifth of how far the quantization moved them from
the float32 model's. For quantized variants the bound is 5e-2, or a third of how far the
quantization itself moved ORT's output from the float32 model's, whichever is larger, and the
classifiers' top-1 class must match. The integer arithmetic itself is checked exactly, op by op,
against the definition in ``tests/ops/contrib`` and ``tests/ops/test_quantize.py``.

    python3 bench/ort_tools.py [--models resnet18 bert_base] [--variants fp32 dynamic float16]
                               [--repeats 10] [--threads N] [--no-write]

Each network's fp32 time is also the yardstick of its float16 variant: issue 17's floor is a
float16 ResNet-18 within 1.3x of its float32 time.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import hashlib
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import onnx
from onnx import helper

import asyncinfer as ai
from bench import architectures, common
from bench.real_models import agreement, relative_error

#: Bump to rebuild every cached variant (the cache key also holds ORT's version and the builders').
VARIANTS_VERSION = 1
MS_DOMAIN = "com.microsoft"
FLOAT_RTOL, FLOAT16_RTOL, QUANTIZED_RTOL = 1e-3, 1e-2, 5e-2
QUANTIZATION_SHARE = 1 / 3  # of the quantization's own error (ORT's output against fp32's), for quantized variants
CALIBRATION_IMAGES = 4


@dataclass(frozen=True)
class Network:
    """A full-size base network: how to build it and feed it, and what the tools need to know."""

    name: str
    build: Callable[[], onnx.ModelProto]
    inputs: Callable[[], dict[str, np.ndarray]]
    kind: str  # "cnn", "bert" or "gpt2": which tools apply (and the optimizer's model type)
    summary: str
    heads: int = 0
    hidden: int = 0


NETWORKS: dict[str, Network] = {n.name: n for n in [
    Network("resnet18", architectures.resnet18, lambda: {"input": architectures.image(1)}, "cnn",
            "ResNet-18, 224², batch 1"),
    Network("mobilenet_v3_small", architectures.mobilenet_v3_small, lambda: {"input": architectures.image(1)}, "cnn",
            "MobileNetV3-small, 224², batch 1"),
    Network("bert_base", lambda: architectures.bert_tiny(layers=12, hidden=768, heads=12, ffn=3072, hf_mask=True),
            architectures.bert_inputs, "bert", "BERT-base: 12 layers of 768, 12 heads, seq 128", heads=12, hidden=768),
    Network("gpt2_small", lambda: architectures.gpt2_decode(layers=12),
            lambda: architectures.gpt2_inputs(layers=12), "gpt2",
            "GPT-2 small decode step: 12 layers of 768, past 127, 50257 logits", heads=12, hidden=768),
]}

# variant -> (the network kinds it applies to, what it is)
VARIANTS: dict[str, tuple[tuple[str, ...], str]] = {
    "fp32": (("cnn", "bert", "gpt2"), "as built"),
    "dynamic": (("cnn", "bert", "gpt2"), "quantize_dynamic, int8 weights, reduce_range"),
    "static_qop_tensor": (("cnn",), "quantize_static, QOperator, per tensor u8/u8"),
    "static_qop_channel": (("cnn",), "quantize_static, QOperator, per channel u8/s8, reduce_range"),
    "static_qdq_tensor": (("cnn",), "quantize_static, QDQ, per tensor u8/u8"),
    "static_qdq_channel": (("cnn",), "quantize_static, QDQ, per channel u8/s8, reduce_range"),
    "optimizer": (("bert", "gpt2"), "transformer optimizer (opt_level 0)"),
    "optimizer_dynamic": (("bert", "gpt2"), "transformer optimizer, then quantize_dynamic"),
    "float16": (("cnn", "bert", "gpt2"), "convert_float_to_float16, float32 inputs and outputs"),
    "ort_extended": (("cnn", "bert", "gpt2"), "ORT's saved ORT_ENABLE_EXTENDED graph"),
    "ort_extended_dynamic": (("cnn", "bert", "gpt2"), "ORT's saved ORT_ENABLE_EXTENDED graph of quantize_dynamic"),
}
QUANTIZED = {"dynamic", "static_qop_tensor", "static_qop_channel", "static_qdq_tensor", "static_qdq_channel",
             "optimizer_dynamic", "ort_extended_dynamic"}


def applies(network: Network, variant: str) -> bool:
    return network.kind in VARIANTS[variant][0]


def rtol_of(variant: str) -> float:
    return FLOAT16_RTOL if variant == "float16" else QUANTIZED_RTOL if variant in QUANTIZED else FLOAT_RTOL


# -- making the variants ----------------------------------------------------------------------------
class _RandomImages:
    """A CalibrationDataReader of a few random normalised images."""

    def __init__(self, feeds: Mapping[str, np.ndarray], count: int = CALIBRATION_IMAGES):
        rng = np.random.default_rng(0)
        self._data = iter([{k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in feeds.items()}
                           for _ in range(count)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._data, None)


def _quantize_static(network: Network, src: Path, dst: Path, qdq: bool, per_channel: bool) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    quantize_static(str(src), str(dst), _RandomImages(network.inputs()),
                    quant_format=QuantFormat.QDQ if qdq else QuantFormat.QOperator, per_channel=per_channel,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8 if per_channel else QuantType.QUInt8, reduce_range=per_channel)


def _quantize_dynamic(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # DefaultTensorType: the type of tensors ORT's shape inference leaves unknown (outputs of
    # com.microsoft ops in an optimized graph), which the quantizer must know
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, reduce_range=True,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


def _optimize(network: Network, src: Path, dst: Path) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    fused = optimize_model(str(src), model_type=network.kind, num_heads=network.heads, hidden_size=network.hidden,
                           opt_level=0)
    fused.save_model_to_file(str(dst))


def _float16(src: Path, dst: Path) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    onnx.save(convert_float_to_float16(onnx.load(str(src)), keep_io_types=True), str(dst))


def _ort_extended(src: Path, dst: Path) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])


def variant_key() -> str:
    import onnxruntime as ort

    text = f"{VARIANTS_VERSION} {architectures.builder_key()} {ort.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def variant_path(network: Network, variant: str) -> Path:
    """The cached ``.onnx`` of ``network`` made by ``variant``'s tool, made first if missing."""
    folder = architectures.cache_dir() / "ort_tools"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{network.name}-{variant}-{variant_key()}.onnx"
    if path.is_file():
        return path
    base = folder / f"{network.name}-fp32-{variant_key()}.onnx"
    if not base.is_file():
        _save_atomically(base, lambda tmp: onnx.save(network.build(), str(tmp)))
    if variant == "fp32":
        return base
    made: dict[str, Callable[[Path], None]] = {
        "dynamic": lambda tmp: _quantize_dynamic(base, tmp),
        "static_qop_tensor": lambda tmp: _quantize_static(network, base, tmp, qdq=False, per_channel=False),
        "static_qop_channel": lambda tmp: _quantize_static(network, base, tmp, qdq=False, per_channel=True),
        "static_qdq_tensor": lambda tmp: _quantize_static(network, base, tmp, qdq=True, per_channel=False),
        "static_qdq_channel": lambda tmp: _quantize_static(network, base, tmp, qdq=True, per_channel=True),
        "optimizer": lambda tmp: _optimize(network, base, tmp),
        "optimizer_dynamic": lambda tmp: _quantize_dynamic(variant_path(network, "optimizer"), tmp),
        "float16": lambda tmp: _float16(base, tmp),
        "ort_extended": lambda tmp: _ort_extended(base, tmp),
        "ort_extended_dynamic": lambda tmp: _ort_extended(variant_path(network, "dynamic"), tmp),
    }
    _save_atomically(path, made[variant])
    return path


def _save_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)``, then rename to ``path``: an interrupted build leaves no half-written model."""
    tmp = path.with_name(path.stem + ".partial.onnx")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


# -- measuring one variant --------------------------------------------------------------------------
def feeds_for(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` in the element types ``model`` declares (the optimizer makes ids and masks int32)."""
    types = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in model.graph.input}
    return {k: v.astype(types[k]) for k, v in feeds.items() if k in types}


def ms_ops(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in model.graph.node if n.domain == MS_DOMAIN).items()))


def _top1(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    first = next(iter(outputs.values()))
    return np.asarray(first).reshape(len(first), -1).argmax(axis=1)


async def measure_async(network: Network, variant: str, *, repeats: int, warmup: int, threads: int,
                        budget_s: float, reference: Mapping[str, np.ndarray] | None) -> dict[str, Any]:
    """Make (or find) the variant, load it in both engines, compare, time. ``reference``: ORT's
    outputs on the fp32 model, to report how far the tool moved them."""
    start = time.perf_counter()
    path = variant_path(network, variant)
    proto = onnx.load(str(path), load_external_data=False)
    result: dict[str, Any] = {"tool": VARIANTS[variant][1], "make_or_cache_s": time.perf_counter() - start,
                              "model_mib": path.stat().st_size / 2**20, "com_microsoft_ops": ms_ops(proto)}
    feeds = feeds_for(proto, network.inputs())
    del proto
    session = common.ort_session(path, threads)
    start = time.perf_counter()
    model = ai.load_model(str(path))
    with ai.Worker(model, "cpu", threads=threads) as worker:
        result["load_s"] = time.perf_counter() - start
        expected = common.ort_outputs(session, feeds)
        start = time.perf_counter()
        got = await worker.run(feeds)
        first = time.perf_counter() - start
        await worker.warmup(feeds)  # (and its choice of serial or parallel runs made: runtime/tuning.py)
        check = architectures.Architecture(network.name, network.build, network.inputs, network.summary,
                                           rtol=rtol_of(variant))
        moved = {} if reference is None or variant == "fp32" else {
            k: relative_error(np.asarray(v, np.float32), np.asarray(reference[k], np.float32))
            for k, v in expected.items() if k in reference}
        rtols = ({k: max(QUANTIZED_RTOL, QUANTIZATION_SHARE * m) for k, m in moved.items()}
                 if variant in QUANTIZED else None)
        result["agreement"] = agreement(check, got, expected, rtols)
        result["ort_vs_fp32_rel"] = moved
        if network.kind == "cnn":
            result["top1_equal"] = bool(np.array_equal(_top1(got), _top1(expected)))
            if not result["top1_equal"]:
                result["agreement"]["ok"] = False
                result["agreement"]["detail"] += "; top-1 differs"
        reps = max(min(3, repeats), min(repeats, int(budget_s / max(first, 1e-6))))
        ort_call = functools.partial(session.run, None, feeds)
        timings = await common.time_interleaved_async({"asyncinfer": lambda: worker.run(feeds), "ort": ort_call},
                                                      repeats=reps, warmup=warmup)
    result.update(repeats=reps, timings={k: v.to_dict() for k, v in timings.items()},
                  ratio=timings["asyncinfer"].median_ms / timings["ort"].median_ms)
    result["expected"] = expected
    return result


# -- the benchmark ----------------------------------------------------------------------------------
def run(models: Sequence[str] = tuple(NETWORKS), variants: Sequence[str] = tuple(VARIANTS), *, repeats: int = 10,
        warmup: int = 1, threads: int | None = None, budget_s: float = 10.0, verbose: bool = True) -> dict[str, Any]:
    """Every applicable (network, variant) pair, fp32 always first (the yardstick of the others);
    one that fails to build, load, run or agree is recorded with its error."""
    unknown = [m for m in models if m not in NETWORKS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown network(s) or variant(s) {unknown}; networks: {', '.join(NETWORKS)}; "
                         f"variants: {', '.join(VARIANTS)}")
    threads = threads or common.default_threads()
    results: dict[str, dict[str, Any]] = {}
    for name in models:
        network = NETWORKS[name]
        per_variant: dict[str, Any] = {}
        reference = None
        for variant in ["fp32"] + [v for v in variants if v != "fp32" and applies(network, v)]:
            if verbose:
                print(f"ort_tools: {name} {variant} ...", flush=True)
            try:
                r = asyncio.run(measure_async(network, variant, repeats=repeats, warmup=warmup, threads=threads,
                                              budget_s=budget_s, reference=reference))
            except Exception as exc:  # noqa: BLE001 - a model an engine cannot run is a finding, not a crash
                per_variant[variant] = {"tool": VARIANTS[variant][1], "error": common.error_text(exc)}
                if verbose:
                    traceback.print_exc()
                continue
            finally:
                gc.collect()  # the big models' weights go before the next one loads
            expected = r.pop("expected")
            reference = expected if variant == "fp32" else reference
            per_variant[variant] = r
            if verbose and not r["agreement"]["ok"]:
                print(f"  !! {r['agreement']['detail']}", flush=True)
        fp32, half = per_variant.get("fp32", {}), per_variant.get("float16", {})
        if "ratio" in fp32 and "ratio" in half:
            half["float16_over_fp32"] = (half["timings"]["asyncinfer"]["median_ms"]
                                         / fp32["timings"]["asyncinfer"]["median_ms"])
        results[name] = {"summary": network.summary, "variants": per_variant}
    measured = [r for n in results.values() for r in n["variants"].values() if "ratio" in r]
    return {
        "threads": threads, "repeats": repeats, "cache_dir": str(architectures.cache_dir() / "ort_tools"),
        "networks": results, "measured": len(measured),
        "geomean_ratio": common.geomean(r["ratio"] for r in measured),
        "failed": sorted(f"{n}/{v}" for n, r in results.items() for v, x in r["variants"].items()
                         if "error" in x or not x["agreement"]["ok"]),
    }


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for name, network in result["networks"].items():
        for variant, r in network["variants"].items():
            if "error" in r:
                rows.append([name, variant, "-", "-", "-", "-", "ERROR " + r["error"][:80]])
                continue
            ops = ", ".join(f"{k}×{v}" for k, v in r["com_microsoft_ops"].items())
            detail = r["agreement"]["detail"] + (f"; fp16/fp32 {r['float16_over_fp32']:.2f}"
                                                 if "float16_over_fp32" in r else "")
            rows.append([name, variant, r["timings"]["asyncinfer"]["median_ms"], r["timings"]["ort"]["median_ms"],
                         r["ratio"], ops[:60] or "-", detail[:90]])
    rows.append(["geomean", "", "", "", result["geomean_ratio"], "", ""])
    common.print_table(["network", "variant", "asyncinfer ms", "ORT ms", "ratio", "com.microsoft ops", "agreement"],
                       rows, title=f"Models made by ORT's tools, {result['threads']} threads each "
                                   f"(ratio: asyncinfer await / ORT session.run, medians)")
    if result["failed"]:
        print(f"\n!!! FAILED OR DISAGREEING: {', '.join(result['failed'])}")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The quick profile: ResNet-18 through the CNN tools, few repeats (the transformers take minutes to
# quantize and optimize at full size).
QUICK: dict[str, Any] = {"models": ("resnet18",), "variants": ("fp32", "dynamic", "static_qop_channel", "float16"),
                         "repeats": 3}


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    return common.missing_modules("onnxruntime", "sympy")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """The geomean asyncinfer/ORT ratio over every measured variant, and how many failed."""
    return {"await/ORT": result["geomean_ratio"], "variants": result["measured"], "failed": len(result["failed"]),
            "resnet18 fp16/fp32": common.dig(result, "networks", "resnet18", "variants", "float16",
                                             "float16_over_fp32")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(NETWORKS), choices=list(NETWORKS), metavar="NETWORK",
                        help=f"networks (default: all of {' '.join(NETWORKS)})")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT",
                        help=f"tools to apply where they fit (default: all of {' '.join(VARIANTS)}; fp32 always runs)")
    parser.add_argument("--quick", action="store_true", help="the quick profile: ResNet-18, four variants, 3 repeats")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per engine and variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per engine first")
    parser.add_argument("--budget", type=float, default=10.0, metavar="SECONDS",
                        help="a slow variant gets fewer repeats (at least 3): about this long of timed runs per engine")
    common.add_engine_args(parser, "ort_tools.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    kwargs = dict(QUICK) if args.quick else {"models": args.models, "variants": args.variants,
                                             "repeats": args.repeats, "warmup": args.warmup}
    result = run(**kwargs, threads=args.threads, budget_s=args.budget)
    return common.report("ort_tools", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
