"""Draw the documentation's figures into docs/img/.

    python3 docs/gen_plots.py                   # every figure, plus the benchmark tables on stdout
    python3 docs/gen_plots.py --diagram-only    # only the task-graph diagram (no results needed)

- ``task_graph.png``: how a scheduled run flows (docs/how-it-runs.md); drawn, not measured.
- ``latency.png``, ``overhead.png``, ``loop_lag.png``: from ``bench/results/latency.json`` and
  ``overhead.json`` (``python3 -m bench latency overhead`` writes them), for docs/benchmarks.md.

The markdown tables printed at the end are what docs/benchmarks.md shows next to the plots.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
DPI = 100
# No timestamps or version strings in the files, so regenerating unchanged figures changes no bytes.
PNG_META = {"Software": None}

COLORS = {
    "asyncinfer_await": "#3b6ea8",
    "asyncinfer_blocking": "#8fb3dc",
    "ort": "#c8733b",
    "light": "#dce8f5",
    "lane": "#f6d7b8",
    "cpu_bound": "#e3e3e3",
    "loop": "#e4f1de",
    "edge": "#444444",
}
LABELS = {"asyncinfer_await": "asyncinfer, await worker.run",
          "asyncinfer_blocking": "asyncinfer, run_blocking",
          "ort": "ONNX Runtime, session.run"}


def _save(fig: plt.Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata=PNG_META)
    plt.close(fig)
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path} ({path.stat().st_size // 1024} KiB)",
          file=sys.stderr)


# -- the task-graph diagram -------------------------------------------------------------------------
def _box(ax, x, y, text, color, w=1.9, h=0.62, size=9.5, weight="normal"):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=color, edgecolor=COLORS["edge"], linewidth=1.0))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, weight=weight)


def _arrow(ax, a, b, style="-|>", color=None, ls="-", rad=0.0, lw=1.2):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=12, color=color or COLORS["edge"],
                                 linestyle=ls, linewidth=lw, connectionstyle=f"arc3,rad={rad}",
                                 shrinkA=2, shrinkB=2))


def draw_task_graph(path: Path) -> None:
    """One scheduled run: the loop thread, the futures of the task graph, the pool and the BLAS lane."""
    fig, ax = plt.subplots(figsize=(11.5, 6.6))
    ax.set_xlim(0, 11.5)
    ax.set_ylim(0, 6.6)
    ax.axis("off")

    # Column titles
    for x, title in ((1.45, "event-loop thread"), (5.6, "task graph: one future per layer"),
                     (9.9, "CPU backend threads")):
        ax.text(x, 6.35, title, ha="center", va="center", fontsize=11, weight="bold")

    # Event-loop column
    _box(ax, 1.45, 5.6, "worker.schedule(x)\nchecks inputs, submits\nevery layer, returns", COLORS["loop"],
         w=2.5, h=0.95)
    _box(ax, 1.45, 4.1, "y = worker.peek_output()\npending Tensor", COLORS["loop"], w=2.5, h=0.75)
    _box(ax, 1.45, 2.6, "await y.readback_and_\nclone_async()\n(task suspended,\nloop keeps running)",
         COLORS["loop"], w=2.5, h=1.15)
    _box(ax, 1.45, 0.95, "task resumes with\na CPU copy of y", COLORS["loop"], w=2.5, h=0.75)
    _arrow(ax, (1.45, 5.12), (1.45, 4.48))
    _arrow(ax, (1.45, 3.72), (1.45, 3.18))
    _arrow(ax, (1.45, 2.02), (1.45, 1.33), ls="--")

    # Task graph (a small branching model)
    nodes = {
        "x": (4.55, 5.6, "input x\n(done)", COLORS["loop"]),
        "shape": (6.65, 5.6, "Shape → Concat\nCPU-bound", COLORS["cpu_bound"]),
        "conv1": (4.55, 4.45, "Conv+Relu", COLORS["lane"]),
        "pool": (4.55, 3.3, "MaxPool", COLORS["light"]),
        "conv2": (6.65, 3.3, "Conv+Relu", COLORS["lane"]),
        "concat": (5.6, 2.15, "Add", COLORS["light"]),
        "reshape": (5.6, 1.0, "Reshape → y", COLORS["light"]),
    }
    for x, y, text, color in nodes.values():
        _box(ax, x, y, text, color, w=1.75, h=0.66 if "\n" in text else 0.5)
    edges = [("x", "conv1"), ("conv1", "pool"), ("conv1", "conv2"), ("pool", "concat"),
             ("conv2", "concat"), ("concat", "reshape")]
    for a, b in edges:
        (xa, ya, *_), (xb, yb, *_) = nodes[a], nodes[b]
        _arrow(ax, (xa, ya - 0.3), (xb, yb + 0.3))
    _arrow(ax, (5.43, 5.6), (5.77, 5.6))  # x -> Shape
    _arrow(ax, (7.4, 5.27), (6.48, 1.1), rad=-0.3)  # the shape value feeds Reshape
    ax.text(7.38, 4.72, "shape value,\nread on the CPU", fontsize=8.5, ha="right", color="#555555")

    # schedule -> futures; future done -> loop wakes
    _arrow(ax, (2.72, 5.6), (3.65, 5.6), color="#2f7d32")
    ax.text(3.18, 5.82, "submit", fontsize=8.5, ha="center", color="#2f7d32")
    _arrow(ax, (4.7, 1.0), (2.72, 2.4), color="#2f7d32", ls="--")
    ax.text(3.1, 1.35, "done callback:\ncall_soon_threadsafe\nwakes the loop", fontsize=8.5, ha="left",
            color="#2f7d32")

    # Thread column
    _box(ax, 9.9, 5.3, "thread pool (core count)\nruns a layer once every\ninput future is done",
         COLORS["light"], w=2.9, h=0.95)
    _box(ax, 9.9, 3.75, "BLAS lane\nGEMM kernels (Conv, MatMul,\nGemm) run one at a time;\nBLAS uses every core",
         COLORS["lane"], w=2.9, h=1.2)
    _box(ax, 9.9, 2.1, "a finishing layer's callbacks\ncount down its readers' missing\ninputs; the thread keeps one\n"
         "ready reader, hands the rest\nto the pool", "#ffffff", w=2.9, h=1.35, size=9)
    _box(ax, 9.9, 0.7, "no thread ever waits\nfor another", "#ffffff", w=2.9, h=0.6, size=9, weight="bold")
    _arrow(ax, (8.45, 3.95), (5.43, 4.45), style="<|-|>", ls=":")
    _arrow(ax, (8.45, 3.55), (7.53, 3.3), style="<|-|>", ls=":")

    ax.text(0.1, 0.12, "colours: green = event loop; orange = BLAS-lane kernels; blue = light kernels; "
            "grey = CPU-bound values (decide later shapes)", fontsize=8.5, color="#555555")
    fig.tight_layout(pad=0.3)
    _save(fig, path)


# -- benchmark plots --------------------------------------------------------------------------------
def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    if not path.is_file():
        print(f"no {path}: run `python3 -m bench latency overhead` first; skipping its plots", file=sys.stderr)
        return None
    return json.loads(path.read_text())


def _machine(env: dict[str, Any]) -> str:
    return (f"{env.get('cpu_count', '?')} cores, {env.get('platform', '?')}; Python {env.get('python', '?')}, "
            f"NumPy {env.get('numpy', '?')}, onnxruntime {env.get('onnxruntime', '?')}; {env.get('timestamp', '?')}")


def plot_latency(data: dict[str, Any], path: Path) -> list[str]:
    res = data["results"]
    models = {k: v for k, v in res["models"].items() if "error" not in v}
    names = list(models)
    engines = ["asyncinfer_await", "asyncinfer_blocking", "ort"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.26
    for i, eng in enumerate(engines):
        med = [models[m]["timings"][eng]["median_ms"] for m in names]
        lo = [med[j] - models[m]["timings"][eng]["p10_ms"] for j, m in enumerate(names)]
        hi = [models[m]["timings"][eng]["p90_ms"] - med[j] for j, m in enumerate(names)]
        xs = [j + (i - 1) * width for j in range(len(names))]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, color=COLORS[eng], label=LABELS[eng],
               error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
    for j, m in enumerate(names):
        ax.text(j, max(models[m]["timings"][e]["p90_ms"] for e in engines) * 1.03,
                f"×{models[m]['ratio_await']:.2f}", ha="center", fontsize=9)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms per inference (median, p10–p90)")
    ax.set_title(f"CPU batch-1 latency, {res['threads']} threads each (×: await / ONNX Runtime)", fontsize=11)
    ax.legend(fontsize=9, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    _save(fig, path)

    rows = ["| model | layers | await ms | run_blocking ms | ONNX Runtime ms | await / ORT | blocking / ORT |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in res["models"].items():
        if "error" in r:
            rows.append(f"| {name} | — | — | — | — | — | skipped: {r['error'][:60]} |")
            continue
        t = r["timings"]
        rows.append(f"| {name} | {r['layers']} | {t['asyncinfer_await']['median_ms']:.1f} | "
                    f"{t['asyncinfer_blocking']['median_ms']:.1f} | {t['ort']['median_ms']:.1f} | "
                    f"{r['ratio_await']:.2f} | {r['ratio_blocking']:.2f} |")
    rows.append(f"| **geometric mean** | | | | | **{res['geomean_ratio_await']:.2f}** | "
                f"**{res['geomean_ratio_blocking']:.2f}** |")
    return [f"Latency ({res['repeats']} timed runs per engine; {_machine(data['environment'])}):", ""] + rows


def plot_overhead(data: dict[str, Any], path: Path) -> list[str]:
    res = data["results"]
    per = res["per_layer"]
    sched = res["schedule"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8), gridspec_kw={"width_ratios": [1, 1.2]})
    engines = ["asyncinfer_await", "asyncinfer_blocking", "ort"]
    us = [per["us_per_layer"][e] for e in engines]
    left.bar(range(3), us, color=[COLORS[e] for e in engines])
    for i, v in enumerate(us):
        left.text(i, v * 1.02, f"{v:.1f}", ha="center", fontsize=9)
    left.set_xticks(range(3), ["await\nworker.run", "run_blocking", "ONNX\nRuntime"])
    left.set_ylabel("µs per layer")
    left.set_title(f"Per-layer cost: chain of {per['layers']} Add layers", fontsize=10.5)

    names = list(sched)
    sched_ms = [sched[n]["schedule"]["median_ms"] for n in names]
    run_ms = [sched[n]["run"]["median_ms"] for n in names]
    ys = range(len(names))
    right.barh([y + 0.2 for y in ys], run_ms, 0.38, color="#bbbbbb", label="whole run (schedule → last output)")
    right.barh([y - 0.2 for y in ys], sched_ms, 0.38, color=COLORS["asyncinfer_await"],
               label="schedule() returns")
    for y, n in zip(ys, names):
        right.text(run_ms[y] * 1.15, y, f"schedule/run = {sched[n]['ratio']:.3f}", va="center", fontsize=9)
    right.set_xscale("log")
    right.set_yticks(list(ys), [f"{n}\n({sched[n]['layers']} layers)" for n in names])
    right.set_xlabel("ms (median, log scale)")
    right.set_xlim(right=max(run_ms) * 30)
    right.set_title("schedule() time vs the run it starts", fontsize=10.5)
    right.legend(fontsize=8.5, frameon=False, loc="center right")
    for a in (left, right):
        a.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    _save(fig, path)

    rows = ["| measurement | asyncinfer (await) | asyncinfer (blocking) | ONNX Runtime |",
            "| --- | ---: | ---: | ---: |",
            f"| per-layer cost, {per['layers']}-Add chain | {us[0]:.1f} µs | {us[1]:.1f} µs | {us[2]:.2f} µs |"]
    for n in names:
        rows.append(f"| `schedule()` / run, {n} | {sched[n]['ratio']:.3f} "
                    f"({sched[n]['schedule']['median_ms']:.2f} of {sched[n]['run']['median_ms']:.1f} ms) | | |")
    return [f"Overhead ({_machine(data['environment'])}):", ""] + rows


def plot_loop_lag(data: dict[str, Any], path: Path) -> list[str]:
    res = data["results"]
    lag = res["loop_lag"]
    cases = list(lag)
    stats = ["p50_ms", "p99_ms", "max_ms"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    width = 0.36
    colors = {cases[0]: "#bbbbbb"}
    for i, case in enumerate(cases):
        vals = [lag[case][s] for s in stats]
        xs = [j + (i - (len(cases) - 1) / 2) * width for j in range(len(stats))]
        label = "baseline (nothing running)" if case == "baseline" else f"while {case} runs back to back"
        ax.bar(xs, vals, width, color=colors.get(case, COLORS["asyncinfer_await"]), label=label)
        for x, v in zip(xs, vals):
            ax.text(x, v * 1.03, f"{v:.2f}", ha="center", fontsize=8.5)
    ax.set_xticks(range(len(stats)), ["p50", "p99", "max"])
    ax.set_ylabel("lateness of a 1 ms timer (ms)")
    ax.set_title("Event-loop lag while a model runs through await worker.run", fontsize=10.5)
    ax.legend(fontsize=9, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    _save(fig, path)

    rows = ["| ticker | ticks | model runs | p50 ms | p99 ms | max ms |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for case in cases:
        r = lag[case]
        rows.append(f"| {case} | {r['ticks']} | {r['model_runs']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                    f"{r['max_ms']:.2f} |")
    return ["Event-loop lag:", ""] + rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results",
                        help="folder with latency.json and overhead.json (default bench/results)")
    parser.add_argument("--out", type=Path, default=DOCS / "img", help="where to write the PNGs (default docs/img)")
    parser.add_argument("--diagram-only", action="store_true", help="only draw task_graph.png")
    args = parser.parse_args(argv)

    draw_task_graph(args.out / "task_graph.png")
    if args.diagram_only:
        return 0
    tables: list[str] = []
    latency = _load(args.results, "latency")
    if latency is not None:
        tables += plot_latency(latency, args.out / "latency.png") + [""]
    overhead = _load(args.results, "overhead")
    if overhead is not None:
        tables += plot_overhead(overhead, args.out / "overhead.png") + [""]
        tables += plot_loop_lag(overhead, args.out / "loop_lag.png") + [""]
    print("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
