"""The ``asyncinfer`` command: ``demo``, ``run``, ``info``, ``serve``, ``operators``, ``conformance``."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import assets
from .backends import BackendType
from .errors import AsyncInferError
from .model.compress import KINDS, MIN_ELEMENTS, quantize_weights
from .model.ir import Model, TensorInfo
from .loader import load_model
from .ops.registry import lookup
from .runtime.profiling import Profile
from .runtime.worker import Worker
from .serving.cli import add_serve_command, bounded, run_serve

BACKEND_CHOICES = [b.value for b in BackendType]


class ProgressBar:
    """A one-line text progress bar on stderr (no dependency).

    On a terminal it is redrawn in place whenever it moves; elsewhere (logs, CI) only the final
    state is written, so captured output stays one line per bar.
    """

    def __init__(self, total: int, label: str, enabled: bool = True, width: int = 30):
        self.total, self.label, self.enabled, self.width = total, label, enabled, width
        self.live = enabled and sys.stderr.isatty()
        self.count = 0
        self.drawn = -1
        self.started = time.perf_counter()

    def advance(self, n: int = 1) -> None:
        self.count += n
        done = self.count >= self.total
        filled = int(self.width * self.count / max(self.total, 1))
        if not self.enabled or not (done or (self.live and filled != self.drawn)):
            return
        self.drawn = filled
        rate = self.count / max(time.perf_counter() - self.started, 1e-9)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                         f"{self.count}/{self.total} ({rate:,.0f}/s)" + ("\n" if done else ""))
        sys.stderr.flush()


# -- demo ------------------------------------------------------------------------------------------
async def _demo(backend: str, batch_size: int, progress: bool) -> int:
    images, labels = assets.default_samples()
    model = load_model(assets.default_model_path())
    print(f"model: {assets.default_model_path().name} ({len(model.layers)} layers after optimisation: "
          f"{', '.join(l.kind for l in model.layers)})")
    print(f"samples: {len(images)} held-out digits; backend: {backend}")
    async with Worker(model, backend) as worker:
        await worker.run(images[:1])  # warm-up: first-touch allocations stay out of the figures

        # Latency: one image per request, each awaited through the readback API.
        bar = ProgressBar(len(images), "latency   ", progress)
        latencies, predictions = [], []
        for image in images:
            start = time.perf_counter()
            worker.schedule(image[None])
            probs = await worker.peek_output("probabilities").readback_and_clone_async()
            latencies.append(time.perf_counter() - start)
            predictions.append(int(np.argmax(probs.numpy()[0])))
            bar.advance()
        accuracy = float(np.mean(np.asarray(predictions) == labels))

        # Throughput: batches in flight concurrently on the thread pool.
        bar = ProgressBar(len(images), "throughput", progress)
        start = time.perf_counter()

        async def one_batch(lo: int) -> np.ndarray:
            out = await worker.run(images[lo:lo + batch_size])
            bar.advance(len(out["probabilities"]))
            return out["probabilities"]

        batches = await asyncio.gather(*(one_batch(lo) for lo in range(0, len(images), batch_size)))
        elapsed = time.perf_counter() - start
        batched_accuracy = float(np.mean(np.argmax(np.concatenate(batches), axis=1) == labels))

    lat_ms = np.asarray(latencies) * 1e3
    print(f"accuracy: {accuracy:.2%} ({int(round(accuracy * len(labels)))}/{len(labels)})"
          f"{'' if batched_accuracy == accuracy else f'; batched {batched_accuracy:.2%}'}")
    print(f"latency (batch 1): p50 {np.percentile(lat_ms, 50):.3f} ms, p99 {np.percentile(lat_ms, 99):.3f} ms")
    print(f"throughput (batch {batch_size}, concurrent): {len(images) / elapsed:,.0f} images/s")
    return 0 if accuracy >= 0.9 else 1


# -- run -------------------------------------------------------------------------------------------
def _concrete_shape(info: TensorInfo, dims: dict[str, int]) -> tuple[int, ...]:
    if info.shape is None:
        raise AsyncInferError(f"input {info.name!r} has no declared shape: pass it with --input")
    return tuple(d if isinstance(d, int) else dims.get(d or "", 1) for d in info.shape)


def _random_input(info: TensorInfo, dims: dict[str, int], rng: np.random.Generator) -> np.ndarray:
    shape = _concrete_shape(info, dims)
    dtype = info.dtype or np.dtype(np.float32)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    return rng.integers(0, 10, size=shape).astype(dtype)


def _load_inputs(model: Model, specs: list[str], random: bool, dims: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise AsyncInferError(f"--input expects name=file.npy, got {spec!r}")
        try:
            inputs[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise AsyncInferError(f"--input {name}: cannot read {path!r}: {exc}") from None
    rng = np.random.default_rng(seed)
    for info in model.inputs:
        if info.name not in inputs:
            if not random:
                raise AsyncInferError(f"input {info.name!r} not given: pass --input {info.name}=file.npy or --random")
            inputs[info.name] = _random_input(info, dims, rng)
    return inputs


async def _run(args: argparse.Namespace) -> int:
    model = load_model(args.model, optimize=not args.no_optimize)
    dims = dict(_parse_dim(d) for d in args.dim)
    inputs = _load_inputs(model, args.input, args.random, dims, args.seed)
    profile = Profile() if args.profile else None
    async with Worker(model, args.backend) as worker:
        if args.warmup:
            await worker.warmup(inputs)
        start = time.perf_counter()
        outputs = await worker.run(inputs, outputs=args.value or None, profile=profile)
        elapsed = time.perf_counter() - start
    for name, value in outputs.items():
        stats = ""
        if value.size and value.dtype.kind in "fiub":
            v = value.astype(np.float64)
            stats = f" min {v.min():.6g} max {v.max():.6g} mean {v.mean():.6g}"
        print(f"{name}: {value.dtype.name}{list(value.shape)}{stats}")
    print(f"ran in {elapsed * 1e3:.2f} ms on {args.backend}{' after a warm-up run' if args.warmup else ''}")
    if profile is not None:
        print(profile.summary())
        profile.write_trace(args.profile)
        print(f"wrote the trace to {args.profile} (open it in ui.perfetto.dev)")
    if args.save:
        np.savez(args.save, **outputs)
        print(f"saved outputs to {args.save}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    """Compress the weights, save, then run both models on the same inputs and say what changed."""
    compressed = quantize_weights(args.model, args.kind, min_elements=args.min_elements)
    compressed.save(args.output)
    print(f"{len(compressed.weights)} weights stored as {args.kind}: {compressed.size_before:,} -> "
          f"{compressed.size_after:,} bytes ({compressed.size_after / compressed.size_before:.0%})")
    original, smaller = load_model(args.model), load_model(args.output)
    if not args.input and args.model.resolve() == assets.default_model_path().resolve():
        inputs = {original.inputs[0].name: assets.default_samples()[0]}
    else:
        inputs = _load_inputs(original, args.input, True, dict(_parse_dim(d) for d in args.dim), args.seed)
    with Worker(original) as a, Worker(smaller) as b:
        before, after = a.run_blocking(inputs), b.run_blocking(inputs)
    for name, ref in before.items():
        got = after[name]
        if ref.dtype.kind != "f" or not ref.size:
            print(f"{name}: {'unchanged' if np.array_equal(ref, got) else 'changed'}")
            continue
        scale = float(np.abs(ref).max()) or 1.0
        line = f"{name}: max abs change {float(np.abs(got - ref).max()):.3g} ({float(np.abs(got - ref).max()) / scale:.2%} of max |value|)"
        if ref.ndim == 2 and ref.shape[1] > 1:
            line += f", top-1 unchanged on {float((ref.argmax(1) == got.argmax(1)).mean()):.1%} of {ref.shape[0]} rows"
        print(line)
    print(f"wrote {args.output}")
    return 0


def _parse_dim(spec: str) -> tuple[str, int]:
    name, sep, value = spec.partition("=")
    if not sep or not value.isdigit():
        raise AsyncInferError(f"--dim expects name=size, got {spec!r}")
    return name, int(value)


# -- info ------------------------------------------------------------------------------------------
def _supported_on(op_type: str, version: int, domain: str) -> list[str]:
    from .operators import backends_supporting

    try:
        lookup(op_type, version, domain)
    except AsyncInferError:
        return []  # not this version of the op
    return backends_supporting(domain, op_type)


def _info(args: argparse.Namespace) -> int:
    from .model.onnx_import import import_model

    raw = import_model(args.model)
    model = load_model(args.model)
    fmt = lambda i: f"  {i.name}: {i.dtype.name if i.dtype is not None else '?'} {list(i.shape) if i.shape is not None else '?'}"  # noqa: E731
    print(f"model: {model.name} (from {model.source}; producer {model.producer or '?'}; opsets {model.opsets})")
    print("inputs:")
    print("\n".join(fmt(i) for i in model.inputs))
    print("outputs:")
    print("\n".join(fmt(o) for o in model.outputs))
    print(f"layers: {len(raw.layers)} imported, {len(model.layers)} after optimisation {model.optimizations}")
    counts = Counter((l.domain, l.op_type, l.version) for l in raw.layers)
    print("ops (count, backends with a kernel):")
    for (domain, op_type, version), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][1])):
        where = ", ".join(_supported_on(op_type, version, domain)) or "none"
        name = f"{domain}::{op_type}" if domain else op_type
        print(f"  {name:<28} {n:>5}  {where}")
    return 0


# -- conformance -----------------------------------------------------------------------------------
def _conformance(args: argparse.Namespace) -> int:
    from . import conformance

    cases = conformance.load_cases(args.filter)
    engines = [("asyncinfer", conformance.asyncinfer_engine(args.backend))]
    if args.compare_onnxruntime:
        engines.append(("onnxruntime", conformance.onnxruntime_engine()))
    reports = [conformance.run_cases(cases, engine, name) for name, engine in engines]
    for report in reports:
        print(conformance.format_report(report, args.backend if report.engine == "asyncinfer" else "cpu",
                                        per_op=not args.summary, failures=args.failures))
    if args.write_passing:
        passing = [r.name for r in reports[0].results if r.passed]
        args.write_passing.write_text("\n".join(passing) + "\n")
        print(f"wrote {len(passing)} passing case names to {args.write_passing}")
    if args.write_wholly:
        wholly = [r.name for r in reports[0].results if r.passed and r.wholly_on_backend]
        args.write_wholly.write_text("\n".join(wholly) + "\n")
        print(f"wrote {len(wholly)} names of cases passing wholly on {args.backend} to {args.write_wholly}")
    # The closing line: asyncinfer's own count, in the form test tooling reads.
    print(f"{reports[0].passed} passed, {reports[0].failed} failed")
    return 0


def _operators(args: argparse.Namespace) -> int:
    from .operators import markdown

    text = markdown()
    if args.output:
        args.output.write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0


# -- entry point -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncinfer", description="Async-first ONNX inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the embedded digits CNN on its samples: accuracy, latency, throughput")
    demo.add_argument("--backend", default="cpu", choices=BACKEND_CHOICES)
    demo.add_argument("--batch-size", type=bounded(int, 1), default=32)
    demo.add_argument("--no-progress", action="store_true", help="do not draw progress bars")

    run = sub.add_parser("run", help="run a model on given or random inputs and summarise the outputs")
    run.add_argument("model", type=Path)
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    run.add_argument("--random", action="store_true", help="random values for inputs not given")
    run.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                     help="size of a symbolic dimension for --random (default 1)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--backend", default="cpu", choices=BACKEND_CHOICES)
    run.add_argument("--no-optimize", action="store_true")
    run.add_argument("--save", type=Path, help="write the outputs to this .npz file")
    run.add_argument("--profile", type=Path, metavar="TRACE.json",
                     help="profile the run: print per-op totals and write a Chrome/Perfetto trace to this file")
    run.add_argument("--warmup", action="store_true",
                     help="run once on the same inputs first, so the timed (and profiled) run is a steady-state one")
    run.add_argument("--value", action="append", default=[], metavar="NAME",
                     help="return this value of the graph instead of the model's outputs (repeatable; "
                          "intermediate values included)")

    quantize = sub.add_parser("quantize", help="store a model's large weights as float16 or uint8 (a smaller ONNX "
                                               "file) and report the size and accuracy change")
    quantize.add_argument("model", type=Path)
    quantize.add_argument("output", type=Path, help="the compressed .onnx file to write")
    quantize.add_argument("--type", dest="kind", default="float16", choices=KINDS)
    quantize.add_argument("--min-elements", type=bounded(int, 1), default=MIN_ELEMENTS,
                          help=f"smaller weights stay float32 (default {MIN_ELEMENTS})")
    quantize.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                          help="inputs to compare the two models on (default: random ones; the embedded "
                               "model's own samples for it)")
    quantize.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                          help="size of a symbolic dimension for random inputs (default 1)")
    quantize.add_argument("--seed", type=int, default=0)

    info = sub.add_parser("info", help="inputs, outputs, ops and which backend supports each op")
    info.add_argument("model", type=Path)

    add_serve_command(sub)

    operators = sub.add_parser("operators", help="the table of supported operators per backend (markdown)")
    operators.add_argument("--output", type=Path, help="write it to this file (docs/operators.md)")

    conf = sub.add_parser("conformance", help="run ONNX's backend node test cases and count passes")
    conf.add_argument("--backend", default="cpu", choices=BACKEND_CHOICES)
    conf.add_argument("--filter", help="regular expression on case names (e.g. 'conv|pool')")
    conf.add_argument("--compare-onnxruntime", action="store_true", help="also run ONNX Runtime through the same harness")
    conf.add_argument("--failures", action="store_true", help="list every failing case with the reason")
    conf.add_argument("--summary", action="store_true", help="no per-op table")
    conf.add_argument("--write-passing", type=Path, metavar="FILE", help="write the names of passing cases")
    conf.add_argument("--write-wholly", type=Path, metavar="FILE",
                      help="write the names of cases that pass with every layer on the backend (no CPU fallback)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return asyncio.run(_demo(args.backend, args.batch_size, not args.no_progress))
        if args.command == "run":
            return asyncio.run(_run(args))
        if args.command == "conformance":
            return _conformance(args)
        if args.command == "operators":
            return _operators(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "quantize":
            return _quantize(args)
        return _info(args)
    except AsyncInferError as exc:
        print(f"asyncinfer: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that cannot be read or written, a port that cannot be bound
        print(f"asyncinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
