"""``python3 -m bench``: run the benchmarks and write one results table.

    python3 -m bench                     # every benchmark, full length (long on a small machine)
    python3 -m bench latency overhead    # a named subset, in the order given
    python3 -m bench --quick             # each benchmark's short profile (a few repeats): a smoke run
    python3 -m bench --list              # the benchmarks, one line each

Each benchmark is a script of this folder (``bench/<name>.py``, runnable on its own) offering
``run()``, ``print_report()``, ``QUICK`` (the keyword arguments of its short profile),
``unavailable_reason()`` and ``key_figures()``. A benchmark that cannot run on this machine is
reported as skipped, with the reason; one that fails is reported with its error, and the others
still run. The table names the machine, gives each benchmark's key asyncinfer/ORT figures and the
floors (informational: they never change the exit status). It is printed, and written to
``bench/results/summary.md`` and ``summary.json`` next to each benchmark's ``<name>.json``.
Exit status: 0, or 1 when a benchmark failed with an error.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from bench import common

# Every benchmark, in the order a full run takes them (the CPU ones first: they gate the floors).
BENCHMARKS: tuple[str, ...] = ("latency", "overhead", "concurrency", "contention", "real_models", "ort_tools", "load_time",
                               "generate", "pixel", "serving", "serving_load", "gpu_compute")

# Our own packages: failing to import one of them is a bug to report, not a missing dependency.
OWN_PACKAGES = ("asyncinfer", "bench")

# schedule() counts as "much less than" the run when it takes at most this share of it.
SCHEDULE_SHARE_FLOOR = 0.1


# -- one benchmark ----------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What became of one benchmark: ``ok`` (with its result), ``skipped`` or ``error`` (with why)."""

    name: str
    status: str
    detail: str = ""
    figures: dict[str, float | None] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return self.status if not self.detail else f"{self.status}: {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        """The summary's view: everything but the full result (that goes to ``<name>.json``)."""
        return {"name": self.name, "status": self.status, "detail": self.detail, "figures": self.figures,
                "seconds": round(self.seconds, 1)}


def load(name: str) -> tuple[ModuleType | None, str | None]:
    """``(bench.<name>, None)``, or ``(None, why)`` when a third-party module it needs is missing."""
    try:
        return importlib.import_module(f"bench.{name}"), None
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] in OWN_PACKAGES:
            raise
        return None, f"needs {exc.name} (not installed)"


def run_kwargs(module: ModuleType, *, quick: bool, threads: int | None) -> dict[str, Any]:
    """Keyword arguments for ``module.run()``: its quick profile, and ``threads`` where it takes one."""
    kwargs = dict(module.QUICK) if quick else {}
    if threads is not None and "threads" in inspect.signature(module.run).parameters:
        kwargs["threads"] = threads
    return kwargs


def run_one(name: str, *, quick: bool = False, threads: int | None = None) -> Outcome:
    """Run one benchmark and print its report; never raises (a failure becomes an ``error`` outcome)."""
    start = time.perf_counter()
    try:
        module, reason = load(name)
        reason = reason or module.unavailable_reason()
        if reason is not None:
            return Outcome(name, "skipped", reason, seconds=time.perf_counter() - start)
        result = module.run(**run_kwargs(module, quick=quick, threads=threads))
        module.print_report(result)
        return Outcome(name, "ok", figures=module.key_figures(result), result=result,
                       seconds=time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - one broken benchmark must not stop the others
        traceback.print_exc()  # the table keeps one line; the traceback is for whoever fixes it
        return Outcome(name, "error", common.error_text(exc), seconds=time.perf_counter() - start)


def describe(name: str) -> str:
    """The first line of the benchmark's docstring, or why it cannot be imported."""
    try:
        module, reason = load(name)
    except Exception as exc:  # noqa: BLE001 - --list must list even a broken benchmark
        return f"(cannot be imported: {common.error_text(exc)})"
    if module is None:
        return f"(cannot be imported: {reason})"
    return (module.__doc__ or "").strip().split("\n")[0]


# -- floors -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Floor:
    """One performance target: ``value`` must be at most ``limit`` (at least, with ``at_least``)."""

    name: str
    value: float | None  # None: could not be measured (e.g. the model did not load)
    limit: float
    unit: str = ""
    at_least: bool = False  # a throughput target: higher is better

    @property
    def verdict(self) -> str:
        if self.value is None or not math.isfinite(self.value):
            return "N/A"
        met = self.value >= self.limit if self.at_least else self.value <= self.limit
        return "PASS" if met else "MISS"

    @property
    def target(self) -> str:
        return f"{'≥' if self.at_least else '≤'} {common.fmt(self.limit)} {self.unit}".rstrip()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "limit": self.limit, "unit": self.unit,
                "at_least": self.at_least, "target": self.target, "verdict": self.verdict}


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def floors(results: Mapping[str, Mapping[str, Any]]) -> list[Floor]:
    """The targets measurable from ``results`` (benchmark name -> result): latency's, real_models',
    overhead's, concurrency's, ort_tools', load_time's, generate's and serving_load's."""
    checks = []
    if (lat := results.get("latency")) is not None:
        checks.append(Floor("geomean latency ratio asyncinfer(await)/ORT", common.dig(lat, "geomean_ratio_await"),
                            1.2, "x"))
    if (real := results.get("real_models")) is not None:
        ratios = [r["ratio"] for r in real.get("models", {}).values() if isinstance(r, Mapping) and "ratio" in r]
        checks += [Floor("real architectures: geomean ratio asyncinfer(await)/ORT", real.get("geomean_ratio"), 1.5, "x"),
                   Floor("real architectures: worst model's ratio", max(ratios) if ratios else None, 3.0, "x")]
    if (ovh := results.get("overhead")) is not None:
        model, chain = ovh["model"], ovh["chain"]
        checks += [
            Floor("per-layer overhead, await worker.run",
                  common.dig(ovh, "per_layer", "us_per_layer", "asyncinfer_await"), 3.0, "µs"),
            Floor("fixed cost of one awaited run of a one-layer model",
                  _times(common.dig(ovh, "fixed_cost", "timings", "asyncinfer_await", "median_ms"), 1e3), 150.0, "µs"),
            Floor(f"event-loop lag p99 while {model} runs", common.dig(ovh, "loop_lag", model, "p99_ms"), 5.0, "ms"),
        ]
        checks += [Floor(f"schedule()/run time, {name}", common.dig(ovh, "schedule", name, "ratio"),
                         SCHEDULE_SHARE_FLOOR, "x") for name in (model, chain)]
    if (conc := results.get("concurrency")) is not None:
        tasks = conc["tasks"]
        for model, r in conc["models"].items():
            lag = ("engines", "asyncinfer", "loop_lag")
            checks += [
                Floor(f"{tasks}-task throughput asyncinfer/ORT, {model}", common.dig(r, "ratio"), 1.0, "x",
                      at_least=True),
                Floor(f"loop lag p99 while {tasks} tasks run, {model}", common.dig(r, *lag, "p99_ms"), 2.0, "ms"),
                Floor(f"loop lag max while {tasks} tasks run, {model}", common.dig(r, *lag, "max_ms"), 10.0, "ms"),
            ]
    if (tools := results.get("ort_tools")) is not None:
        checks.append(Floor("models made by ORT's tools that fail to load, run or agree with ORT",
                            float(len(tools["failed"])) if tools["measured"] else None, 0.0))
        if "resnet18" in tools["networks"]:
            checks.append(Floor("float16 ResNet-18, x its float32 time (asyncinfer)",
                                common.dig(tools, "networks", "resnet18", "variants", "float16", "float16_over_fp32"),
                                1.3, "x"))
    if (lt := results.get("load_time")) is not None:
        for model, r in lt["models"].items():
            if "error" in r:
                continue
            checks += [
                Floor(f"load of {model} (external data), asyncinfer/ORT session", r["load_ratio"], 2.0, "x"),
                Floor(f"peak RSS after a run of {model}, x model size", r["rss_run_x_model"]["asyncinfer"], 1.5, "x"),
                Floor(f"first run after warmup() of {model}, x steady state", r["first_after_warmup_x_steady"], 1.2, "x"),
            ]
    if (gen := results.get("generate")) is not None:
        n = gen["streams"]
        for model, r in gen["models"].items():
            ours = ("engines", "asyncinfer")
            checks += [
                Floor(f"generate {model}: ms/token, one stream, asyncinfer/ORT IO-binding loop",
                      common.dig(r, "ratios", "ort_iobinding", "per_token"), 1.2, "x"),
                Floor(f"generate {model}: {n} streams' tokens/s, x one stream's",
                      common.dig(r, *ours, f"{n}_streams", "x_one_stream"), 4.0, "x", at_least=True),
                Floor(f"generate {model}: loop lag p99 while {n} streams run",
                      common.dig(r, *ours, f"{n}_streams", "loop_lag", "p99_ms"), 2.0, "ms"),
                Floor(f"generate {model}: greedy tokens equal ORT's, and each of {n} streams its solo run",
                      None if "identical_tokens" not in r else float(all(r["identical_tokens"].values())), 1.0,
                      at_least=True),
            ]
    if (load := results.get("serving_load")) is not None:
        for model, r in load["models"].items():
            if not r.get("batchable"):
                continue  # a fixed batch of 1 leaves nothing to merge: the target is about batching
            row = (r.get("concurrency") or {}).get("8") or {}
            # serve --workers N where measured (bench/serving_load.py's floor_kind), else one process
            kind = next((k for k in row if k.startswith("asyncinfer_w")), "asyncinfer")
            label = "" if kind == "asyncinfer" else f" --workers {kind[len('asyncinfer_w'):]}"
            checks += [
                Floor(f"serve{label} at concurrency 8, batching/ORT+FastAPI throughput, {model}",
                      common.dig(row, kind, "throughput_vs_baseline"), 1.5, "x", at_least=True),
                Floor(f"serve{label} at concurrency 8, batching/ORT+FastAPI p99, {model}",
                      common.dig(row, kind, "p99_vs_baseline"), 1.0, "x"),
            ]
    return checks


# -- the table --------------------------------------------------------------------------------------
def _cell(value: Any) -> str:
    """A figure for the table: 3 significant digits, '-' when it could not be measured."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return common.fmt(value)


def _escape(text: str) -> str:
    """Table cells must not contain the column separator (error texts can)."""
    return text.replace("|", "\\|")


def summary(outcomes: Sequence[Outcome], *, quick: bool, threads: int | None, command: str) -> dict[str, Any]:
    """The run in one dict: what summary.json holds (under ``results``) and summary.md shows."""
    checks = floors({o.name: o.result for o in outcomes if o.result is not None})
    return {"command": command, "profile": "quick" if quick else "full",
            "threads": threads or common.default_threads(),
            "benchmarks": [o.to_dict() for o in outcomes], "floors": [c.to_dict() for c in checks]}


def render_markdown(data: Mapping[str, Any], env: Mapping[str, Any]) -> str:
    """summary.md: the machine, one row per benchmark, then the floors."""
    lines = [
        "# Benchmark summary", "",
        f"- Machine: {env['cpu_model']}, {env['cpu_count']} cores ({env['platform']})",
        f"- Python {env['python']}, numpy {env['numpy']}, onnx {env['onnx']}, "
        f"onnxruntime {env['onnxruntime']}, asyncinfer {env['asyncinfer']}",
        f"- BLAS: {env.get('blas', 'unknown')}",
        f"- Date: {env['timestamp']}",
        f"- Command: `{data['command']}` ({data['profile']} profile, {data['threads']} threads)", "",
        "Ratios are asyncinfer / ONNX Runtime measured in the same process: below 1 is faster for "
        "latency, above 1 is more requests/s for throughput (`×ORT`). A quick profile is a smoke run, "
        "not a measurement.", "",
        "| benchmark | result | key figures | seconds |",
        "| --- | --- | --- | ---: |",
    ]
    for b in data["benchmarks"]:
        figures = "; ".join(f"{k} {_cell(v)}" for k, v in b["figures"].items())
        result = b["status"] if not b["detail"] else f"{b['status']}: {b['detail']}"
        lines.append(f"| {b['name']} | {_escape(result)} | {_escape(figures)} | {b['seconds']} |")
    if data["floors"]:
        lines += ["", "## Floors (informational: they never fail the run)", "",
                  "| floor | measured | target | verdict |", "| --- | ---: | --- | --- |"]
        lines += [f"| {f['name']} | {_cell(f['value'])} | {f['target']} | {f['verdict']} |" for f in data["floors"]]
    return "\n".join(lines) + "\n"


def write(outcomes: Sequence[Outcome], data: Mapping[str, Any], markdown: str, env: Mapping[str, Any]) -> None:
    """Each benchmark's ``<name>.json`` (docs/gen_plots.py reads them) and summary.json / summary.md."""
    for o in outcomes:
        if o.result is not None:
            common.write_results(o.name, o.result, env=env)
    path = common.write_results("summary", data, env=env)
    (path.parent / "summary.md").write_text(markdown)
    print(f"\nwrote {path.with_suffix('.md')} and {path.name} (and each benchmark's <name>.json)")


# -- command line -----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m bench", description="Run the asyncinfer benchmarks "
                                     "(all, or those named) and write one results table.")
    parser.add_argument("names", nargs="*", metavar="BENCHMARK",
                        help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--quick", action="store_true", help="each benchmark's short profile (a few repeats)")
    common.add_engine_args(parser, "<name>.json and summary.{md,json}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)} (choose from {', '.join(BENCHMARKS)})")
    args.names = list(dict.fromkeys(args.names)) or list(BENCHMARKS)  # keep the order, drop repeats
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.list:
        width = max(map(len, BENCHMARKS))
        for name in BENCHMARKS:
            print(f"{name.ljust(width)}  {describe(name)}")
        return 0
    outcomes = []
    for name in args.names:
        print(f"\n=== {name}{' (quick)' if args.quick else ''} ===", flush=True)
        outcomes.append(run_one(name, quick=args.quick, threads=args.threads))
        if outcomes[-1].status != "ok":
            print(outcomes[-1].label, flush=True)
    env = common.environment()
    data = summary(outcomes, quick=args.quick, threads=args.threads, command=" ".join(["python3 -m bench", *argv]))
    markdown = render_markdown(data, env)
    print("\n" + markdown, end="")
    if not args.no_write:
        write(outcomes, data, markdown, env)
    return 1 if any(o.status == "error" for o in outcomes) else 0
