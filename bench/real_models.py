"""Real architectures built layer by layer with random weights (ResNet-18 ... LSTM VAD): asyncinfer vs ORT.

ResNet-18, MobileNetV3-small (batch 1, 32, float16), EfficientNet-B0, ConvNeXt-T, BERT-tiny, a GPT-2
decode step, Llama layers, an SSDLite detector with NonMaxSuppression and a Silero-style LSTM VAD.

The networks are written in ``bench/architectures.py`` (no torch needed) and cached. For each one,
in this process: load time of both engines, their first run, then steady-state latency of one
awaited run, interleaved in alternating blocks:
asyncinfer ``await worker.run(inputs)`` on the "cpu" backend, ORT ``session.run`` (the engine's own
cost, as in latency.py) and ORT through ``await loop.run_in_executor(None, session.run, ...)``
(what an asyncio server would call). Outputs are compared with ORT's first and the agreement is
reported per model; a disagreement never stops the run, it is flagged in the table.

    python3 bench/real_models.py [--models resnet18 bert_tiny] [--repeats 20] [--warmup 2] [--budget 20]
                                 [--threads N] [--profile] [--no-write]

``--profile`` adds, per model, where the time goes: asyncinfer's layer time per op type (its own
`asyncinfer.Profile`) next to ORT's own profiler per op type, and asyncinfer's heaviest layers
with their output shapes.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import asyncinfer as ai
from bench import architectures, common

MODELS: tuple[str, ...] = tuple(architectures.ARCHITECTURES)
# The quick profile leaves out the models that take seconds to build, load or run here
# (MobileNetV3 at batch 32, ConvNeXt-T, the GPT-2 decode step and the Llama layers).
QUICK_MODELS: tuple[str, ...] = tuple(n for n, a in architectures.ARCHITECTURES.items() if not a.large)
TOP_LAYERS = int(os.environ.get("BENCH_TOP_LAYERS", "4"))  # heaviest layers printed by --profile
CONTESTANTS = ("asyncinfer", "ort", "ort_executor")
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


# -- agreement --------------------------------------------------------------------------------------
def agreement(arch: architectures.Architecture, got: Mapping[str, Any],
              want: Mapping[str, np.ndarray], rtols: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Compare asyncinfer's outputs with ORT's: ``{"ok", "max_rel_err", "detail", "outputs"}``.

    Float outputs: max abs difference over the reference's largest magnitude, within
    ``arch.rtol`` (1e-3, float16 1e-2) or the output's own bound in ``rtols``; dtypes must match.
    Index outputs (NMS selections) must be equal row by row; the first differing row is reported.
    """
    per_output: dict[str, str] = {}
    problems: list[str] = []
    worst = 0.0
    for name, ref in want.items():
        if name not in got:
            problems.append(f"{name}: missing")
            continue
        out = np.asarray(got[name])
        if out.dtype != ref.dtype:
            problems.append(f"{name}: dtype {out.dtype} != ORT {ref.dtype}")
        if name in arch.index_outputs:
            per_output[name] = _compare_rows(out, ref)
            if per_output[name] != "equal":
                problems.append(f"{name}: {per_output[name]}")
            continue
        if out.shape != ref.shape:
            problems.append(f"{name}: shape {out.shape} != ORT {ref.shape}")
            continue
        if ref.size == 0:
            continue
        rel = relative_error(out, ref)
        per_output[name] = f"{rel:.2g}"
        worst = max(worst, rel)
        bound = (rtols or {}).get(name, arch.rtol)
        if rel > bound:
            problems.append(f"{name}: rel. err {rel:.3g} > {bound:.3g}")
    ok = not problems
    detail = f"ok (rel {worst:.1g})" if ok else "MISMATCH " + "; ".join(problems)
    return {"ok": ok, "max_rel_err": worst, "rtol": arch.rtol, "detail": detail, "outputs": per_output}


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """Max abs difference over the reference's largest magnitude (inf or NaN in either: 0 where
    both are identical, else inf)."""
    scale = float(np.max(np.abs(ref.astype(np.float64))))
    diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
    rel = float(np.max(diff)) / max(scale, 1e-30)
    if not np.isfinite(rel):
        rel = 0.0 if np.array_equal(out, ref, equal_nan=True) else float("inf")
    return rel


def _compare_rows(out: np.ndarray, ref: np.ndarray) -> str:
    """'equal', or how two index tables (one row per selected box) differ."""
    if out.ndim != 2 or ref.ndim != 2 or out.shape[1:] != ref.shape[1:]:
        return f"shape {out.shape} != ORT {ref.shape}"
    n = min(len(out), len(ref))
    differ = np.flatnonzero(np.any(out[:n] != ref[:n], axis=1))
    if len(out) == len(ref) and differ.size == 0:
        return "equal"
    same = n - differ.size
    first = int(differ[0]) if differ.size else n
    return (f"{len(out)} rows vs ORT {len(ref)}, {same} of the first {n} equal; "
            f"first difference at row {first}")


# -- one model --------------------------------------------------------------------------------------
def _ms(seconds: float) -> float:
    return seconds * 1e3


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


async def measure_model_async(name: str, *, repeats: int = 20, warmup: int = 2, threads: int | None = None,
                              budget_s: float = 20.0, profile: bool = False, profile_runs: int = 5) -> dict[str, Any]:
    """Load times, first runs, agreement and interleaved latency of one architecture.

    A model whose runs take long gets fewer repeats (at least 3): about ``budget_s`` of timed
    runs per engine, so the slow ones (MobileNetV3 at batch 32 here) do not take an hour. The
    budget goes by a run after the warm-up, not by the first: a first run compiles kernels on a
    clean checkout (seconds), which left a 0.1 ms voice detector 3 samples and its ratio at the
    mercy of one noisy moment.
    """
    arch = architectures.ARCHITECTURES[name]
    threads = threads or common.default_threads()
    start = time.perf_counter()
    path = architectures.model_path(name)
    build_s = time.perf_counter() - start
    path.read_bytes()  # into the page cache, so neither engine's load time pays the disk
    inputs = arch.inputs()
    result: dict[str, Any] = {"summary": arch.summary, "threads": threads, "model_mib": path.stat().st_size / 2**20,
                              "build_or_cache_s": build_s}

    start = time.perf_counter()
    session = common.ort_session(path, threads)
    ort_load = time.perf_counter() - start
    start = time.perf_counter()
    model = ai.load_model(str(path))
    ai_load_model = time.perf_counter() - start
    with ai.Worker(model, "cpu", threads=threads) as worker:
        ai_load = time.perf_counter() - start
        feed = dict(inputs)
        start = time.perf_counter()
        expected = common.ort_outputs(session, feed)
        ort_first = time.perf_counter() - start
        start = time.perf_counter()
        got = await worker.run(inputs)
        ai_first = time.perf_counter() - start
        await worker.warmup(inputs)  # (and its choice of serial or parallel runs made: runtime/tuning.py)
        result.update(
            layers=len(model.layers), onnx_nodes=_node_count(path),
            load_ms={"asyncinfer": _ms(ai_load), "asyncinfer_load_model": _ms(ai_load_model), "ort": _ms(ort_load)},
            first_run_ms={"asyncinfer": _ms(ai_first), "ort": _ms(ort_first)},
            agreement=agreement(arch, got, expected))

        start = time.perf_counter()
        await worker.run(inputs)
        ai_steady = time.perf_counter() - start
        start = time.perf_counter()
        session.run(None, feed)
        slowest = max(ai_steady, time.perf_counter() - start, 1e-6)
        repeats = max(min(3, repeats), min(repeats, int(budget_s / slowest)))
        warmup = min(warmup, max(1, int(budget_s / 4 / slowest)))
        result.update(repeats=repeats, warmup=warmup)
        loop = asyncio.get_running_loop()
        ort_call = functools.partial(session.run, None, feed)
        load_before = _loadavg()
        timings = await common.time_interleaved_async({
            "asyncinfer": lambda: worker.run(inputs),
            "ort": ort_call,
            "ort_executor": lambda: loop.run_in_executor(None, ort_call),
        }, repeats=repeats, warmup=warmup)
        result["loadavg_1min"] = [load_before, _loadavg()]
        if profile:
            result["profile"] = profile_model(worker, model, path, inputs, threads=threads, runs=profile_runs)
    del session
    t = timings
    result.update(
        timings={k: v.to_dict() for k, v in t.items()},
        ratio=t["asyncinfer"].median_ms / t["ort"].median_ms,
        ratio_executor=t["asyncinfer"].median_ms / t["ort_executor"].median_ms,
        ratio_best=t["asyncinfer"].min_ms / t["ort"].min_ms)
    return result


def _node_count(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def measure_model(name: str, **kwargs: Any) -> dict[str, Any]:
    try:
        return asyncio.run(measure_model_async(name, **kwargs))
    finally:
        gc.collect()  # the big models' weights go before the next one loads


# -- profiles ---------------------------------------------------------------------------------------
def _layer_records(profile: ai.Profile) -> list[tuple[str, str, str, list, float]]:
    """The layers a `Profile` recorded: (op family, op type with fused activations, layer name,
    output shapes, seconds)."""
    records = []
    for r in profile.records:
        if r.kind != "layer":
            continue
        base = r.op_type.split("+", 1)[0]
        records.append((_FAMILY.get(base, base), r.op_type, r.layer, [tuple(s) for s in r.output_shapes],
                        r.duration_ns * 1e-9))
    return records


# Op types compared as one family: ORT rewrites MatMul+Add into Gemm (and back), fuses activations
# into FusedConv/FusedGemm/FusedMatMul; asyncinfer folds activations into the layer (its "kind").
_FAMILY = {"FusedConv": "Conv", "Gemm": "MatMul/Gemm", "FusedGemm": "MatMul/Gemm", "MatMul": "MatMul/Gemm",
           "MatMulBias": "MatMul/Gemm",
           "FusedMatMul": "MatMul/Gemm"}


def _ort_profile(path: Path, inputs: Mapping[str, np.ndarray], threads: int, runs: int) -> dict[str, Any]:
    """ORT's own profiler over ``runs`` runs (after one untimed): per-node kernel times."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        options.profile_file_prefix = os.path.join(tmp, "ort")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        feed = dict(inputs)
        session.run(None, feed)
        walls = []
        for _ in range(runs):
            start = time.perf_counter()
            session.run(None, feed)
            walls.append(time.perf_counter() - start)
        events = json.loads(Path(session.end_profiling()).read_text())
    model_runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                        if e.get("cat") == "Session" and e.get("name") == "model_run")[-runs:]
    nodes = []
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if not any(lo <= e["ts"] <= hi for lo, hi in model_runs):
            continue
        args = e.get("args", {})
        op = args.get("op_name", "?")
        shapes = [tuple(next(iter(d.values()))) for d in args.get("input_type_shape", []) if d]
        nodes.append((_FAMILY.get(op, op), op, e["name"].removesuffix("_kernel_time"), shapes, e["dur"] * 1e-6))
    return {"wall_ms": _ms(float(np.median(walls))), "nodes": nodes, "runs": runs}


def _by_op(records: Sequence[tuple], runs: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for base, kind, _name, _shapes, seconds in records:
        entry = out.setdefault(base, {"ms": 0.0, "count": 0, "kinds": collections.Counter()})
        entry["ms"] += _ms(seconds) / runs
        entry["count"] += 1
        entry["kinds"][kind] += 1
    for entry in out.values():
        entry["count"] //= runs
        entry["kinds"] = {k: v // runs for k, v in entry["kinds"].items()}
    return out


def _top_layers(records: Sequence[tuple], runs: int, n: int = 6) -> list[dict[str, Any]]:
    per_layer: dict[str, list] = {}
    for base, kind, name, shapes, seconds in records:
        entry = per_layer.setdefault(name, [kind, shapes, 0.0])
        entry[2] += _ms(seconds) / runs
    top = sorted(per_layer.items(), key=lambda kv: -kv[1][2])[:n]
    return [{"layer": name, "kind": kind, "shapes": [list(s) for s in shapes], "ms": ms}
            for name, (kind, shapes, ms) in top]


def profile_model(worker: ai.Worker, model: ai.Model, path: Path, inputs: Mapping[str, np.ndarray], *,
                  threads: int, runs: int = 5) -> dict[str, Any]:
    """Per op type: asyncinfer's kernel time vs ORT's, and the time lost (asyncinfer - ORT), in ms per run.

    ORT fuses more than asyncinfer (Gelu, LayerNormalization, Attention, SkipLayerNormalization...):
    such ORT-only op types show up with a negative loss, to be read against the asyncinfer op types
    they replace. ``overhead_ms`` is asyncinfer's wall time beyond its kernel time (scheduling,
    Python, idle threads; negative when layers overlap on the pool).
    """
    profile = ai.Profile("bench")
    walls = []
    worker.run_blocking(dict(inputs))
    for _ in range(runs):
        start = time.perf_counter()
        worker.run_blocking(dict(inputs), profile=profile)
        walls.append(time.perf_counter() - start)
    records = _layer_records(profile)
    ai_ops = _by_op(records, runs)
    ort_prof = _ort_profile(path, inputs, threads, runs)
    ort_ops = _by_op(ort_prof["nodes"], runs)
    rows = []
    for op in set(ai_ops) | set(ort_ops):
        a, o = ai_ops.get(op), ort_ops.get(op)
        rows.append({"op": op, "asyncinfer_ms": a["ms"] if a else 0.0, "asyncinfer_count": a["count"] if a else 0,
                     "asyncinfer_kinds": a["kinds"] if a else {}, "ort_ms": o["ms"] if o else 0.0,
                     "ort_count": o["count"] if o else 0, "ort_kinds": o["kinds"] if o else {},
                     "lost_ms": (a["ms"] if a else 0.0) - (o["ms"] if o else 0.0)})
    rows.sort(key=lambda r: -r["lost_ms"])
    ai_wall = _ms(float(np.median(walls)))
    ai_kernels = sum(r["asyncinfer_ms"] for r in rows)
    return {"runs": runs, "asyncinfer_wall_ms": ai_wall, "asyncinfer_kernel_ms": ai_kernels,
            "overhead_ms": ai_wall - ai_kernels, "ort_wall_ms": ort_prof["wall_ms"],
            "ort_kernel_ms": sum(r["ort_ms"] for r in rows), "op_types": rows,
            "top_layers": {"asyncinfer": _top_layers(records, runs), "ort": _top_layers(ort_prof["nodes"], runs)}}


# -- the benchmark ----------------------------------------------------------------------------------
def run(models: Sequence[str] = MODELS, *, repeats: int = 20, warmup: int = 2, threads: int | None = None,
        budget_s: float = 20.0, profile: bool = False, profile_runs: int = 5, verbose: bool = True) -> dict[str, Any]:
    """Measure every model; one that fails to build or load is recorded with its error."""
    unknown = [m for m in models if m not in architectures.ARCHITECTURES]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    per_model: dict[str, Any] = {}
    for name in models:
        if verbose:
            print(f"real_models: {name} ...", flush=True)
        try:
            per_model[name] = measure_model(name, repeats=repeats, warmup=warmup, threads=threads,
                                            budget_s=budget_s, profile=profile, profile_runs=profile_runs)
        except Exception as exc:  # noqa: BLE001 - a model either engine cannot run is a finding, not a crash
            per_model[name] = {"error": common.error_text(exc)}
            if verbose:
                traceback.print_exc()
                print(f"  error: {per_model[name]['error']}", flush=True)
            continue
        if verbose and not per_model[name]["agreement"]["ok"]:
            print(f"  !! {per_model[name]['agreement']['detail']}", flush=True)
    measured = {n: r for n, r in per_model.items() if "error" not in r}
    skipped = [n for n in MODELS if n not in models]
    return {
        "repeats": repeats, "warmup": warmup, "budget_s": budget_s, "threads": threads or common.default_threads(),
        # OpenBLAS/OpenMP pool sizes change asyncinfer's GEMM timings a lot on a shared machine
        "blas_env": {k: os.environ.get(k) for k in BLAS_ENV},
        "cache_dir": str(architectures.cache_dir()), "builder_key": architectures.builder_key(),
        "models": per_model, "not_run": skipped,
        "geomean_ratio": common.geomean(r["ratio"] for r in measured.values()),
        "geomean_ratio_executor": common.geomean(r["ratio_executor"] for r in measured.values()),
        "geomean_ratio_best": common.geomean(r["ratio_best"] for r in measured.values()),
        "measured": len(measured),
        "mismatches": sorted(n for n, r in measured.items() if not r["agreement"]["ok"]),
        "errors": sorted(n for n, r in per_model.items() if "error" in r),
    }


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for name, r in result["models"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", "ERROR " + r["error"][:70]])
            continue
        t = r["timings"]
        rows.append([name if r["repeats"] == result["repeats"] else f"{name} (n={r['repeats']})",
                     t["asyncinfer"]["median_ms"], t["ort"]["median_ms"], r["ratio"],
                     t["ort_executor"]["median_ms"], r["ratio_best"],
                     r["load_ms"]["asyncinfer"] / 1e3, r["load_ms"]["ort"] / 1e3, r["agreement"]["detail"][:90]])
    rows.append(["geomean", "", "", result["geomean_ratio"], "", result["geomean_ratio_best"], "", "", ""])
    common.print_table(["model", "asyncinfer ms", "ORT ms", "ratio", "ORT exec ms", "best/best", "load ai s",
                        "load ORT s", "agreement"], rows,
                       title=f"Real architectures, median of {result['repeats']} interleaved runs, "
                             f"{result['threads']} threads each (ratio: asyncinfer await / ORT session.run)")
    blas = ", ".join(f"{k}={v}" for k, v in result["blas_env"].items() if v)
    print(f"BLAS threads: {blas or 'library defaults (OpenBLAS: one per core)'}")
    if result["not_run"]:
        print(f"not run in this profile: {', '.join(result['not_run'])}")
    if result["mismatches"]:
        print(f"\n!!! OUTPUTS DISAGREE WITH ORT: {', '.join(result['mismatches'])} (timed anyway; see agreement)")
    for name, r in result["models"].items():
        if "profile" in r:
            print_profile(name, r["profile"])


def print_profile(name: str, p: dict[str, Any], top: int = 6) -> None:
    rows = [[r["op"], r["asyncinfer_ms"], r["asyncinfer_count"], r["ort_ms"], r["ort_count"], r["lost_ms"],
             ", ".join(f"{k}×{v}" for k, v in list(r["asyncinfer_kinds"].items())[:3])]
            for r in p["op_types"][:top]]
    rows += [[r["op"], r["asyncinfer_ms"], r["asyncinfer_count"], r["ort_ms"], r["ort_count"], r["lost_ms"],
              "ORT only (fused)"] for r in p["op_types"][top:] if r["asyncinfer_count"] == 0 and r["ort_ms"] > 0.05]
    common.print_table(["op type", "ai ms", "ai n", "ORT ms", "ORT n", "lost ms", "asyncinfer kinds"], rows,
                       title=f"{name}: asyncinfer wall {p['asyncinfer_wall_ms']:.2f} ms (kernels "
                             f"{p['asyncinfer_kernel_ms']:.2f}, overhead {p['overhead_ms']:.2f}) vs ORT wall "
                             f"{p['ort_wall_ms']:.2f} ms (kernels {p['ort_kernel_ms']:.2f}); per run")
    for layer in p["top_layers"]["asyncinfer"][:TOP_LAYERS]:
        print(f"    {layer['ms']:8.2f} ms  {layer['kind']:24s} {layer['layer']}  {layer['shapes']}")


# -- `python -m bench` (bench/runner.py) ---------------------------------------------------------
# The --quick profile: the models that build, load and run in a second or so, 3 repeats.
QUICK: dict[str, Any] = {"models": QUICK_MODELS, "repeats": 3, "warmup": 1}


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    return common.missing_modules("onnxruntime")


def key_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """Geometric means over the models of asyncinfer/ORT median latency (lower is better)."""
    return {"await/ORT": result["geomean_ratio"], "await/ORT executor": result["geomean_ratio_executor"],
            "best/best": result["geomean_ratio_best"], "models": result["measured"],
            "mismatches": len(result["mismatches"])}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, metavar="MODEL",
                        help=f"architectures to run (default: all of {' '.join(MODELS)})")
    parser.add_argument("--quick", action="store_true", help=f"the quick profile: {' '.join(QUICK_MODELS)}, "
                        "3 repeats (overrides --models/--repeats/--warmup)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per engine and model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per engine first")
    parser.add_argument("--budget", type=float, default=20.0, metavar="SECONDS",
                        help="a slow model gets fewer repeats (at least 3): about this long of timed runs per engine")
    parser.add_argument("--profile", action="store_true", help="also profile per op type (asyncinfer vs ORT)")
    parser.add_argument("--profile-runs", type=int, default=5, help="runs per engine in each profile")
    common.add_engine_args(parser, "real_models.json")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        return common.cannot_run(__file__, reason)
    kwargs = dict(QUICK) if args.quick else {"models": args.models, "repeats": args.repeats, "warmup": args.warmup}
    result = run(**kwargs, threads=args.threads, budget_s=args.budget, profile=args.profile,
                 profile_runs=args.profile_runs)
    return common.report("real_models", result, print_report, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
