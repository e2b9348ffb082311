"""Run every benchmark and print a summary against the performance floors.

The floors are targets, not tests: each prints PASS or MISS and the exit status is 0 either way
(timing on a shared machine is too noisy to gate on).

    python3 bench/run_all.py            # full run, about 5-10 minutes on 2 cores
    python3 bench/run_all.py --quick    # a few repeats of everything, about a minute
    python3 -m bench                    # the same as bench/run_all.py
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and the checkout's asyncinfer importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, latency, overhead

# schedule() counts as "much less than" the run when it takes at most this share of it.
SCHEDULE_SHARE_FLOOR = 0.1


@dataclass(frozen=True)
class Floor:
    """One performance target: ``value`` must be at most ``limit``."""

    name: str
    value: float | None  # None: could not be measured (e.g. the model did not load)
    limit: float
    unit: str = ""

    @property
    def verdict(self) -> str:
        if self.value is None or not math.isfinite(self.value):
            return "N/A"
        return "PASS" if self.value <= self.limit else "MISS"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "limit": self.limit, "unit": self.unit,
                "verdict": self.verdict}


def _get(result: dict[str, Any], *keys: str) -> float | None:
    """``result[k1][k2]...`` or None when a step is missing (a skipped measurement)."""
    for key in keys:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return float(result) if isinstance(result, (int, float)) else None


def floors(lat: dict[str, Any], ovh: dict[str, Any]) -> list[Floor]:
    model = ovh["model"]
    chain = ovh["chain"]
    result = [
        Floor("geomean latency ratio asyncinfer(await)/ORT", _get(lat, "geomean_ratio_await"), 2.0, "x"),
        Floor("per-layer overhead, await worker.run", _get(ovh, "per_layer", "us_per_layer", "asyncinfer_await"),
              50.0, "µs"),
        Floor(f"event-loop lag p99 while {model} runs", _get(ovh, "loop_lag", model, "p99_ms"), 5.0, "ms"),
    ]
    for name in (model, chain):
        result.append(Floor(f"schedule()/run time, {name}", _get(ovh, "schedule", name, "ratio"),
                            SCHEDULE_SHARE_FLOOR, "x"))
    return result


def print_summary(lat: dict[str, Any], ovh: dict[str, Any], checks: list[Floor]) -> None:
    print("\nSUMMARY")
    print(f"  latency geomean ratio (asyncinfer/ORT) over {lat['measured']} model(s): "
          f"await {common.fmt(lat['geomean_ratio_await'])}, blocking {common.fmt(lat['geomean_ratio_blocking'])}, "
          f"best/best {common.fmt(lat['geomean_ratio_best'])}")
    per_layer = ovh["per_layer"].get("us_per_layer")
    if per_layer:
        print("  per-layer overhead (µs): " + ", ".join(f"{k} {common.fmt(v)}" for k, v in per_layer.items()))
    base = ovh["loop_lag"].get("baseline", {})
    if "p99_ms" in base:
        print(f"  loop-lag baseline (no model): p50 {common.fmt(base['p50_ms'])} ms, "
              f"p99 {common.fmt(base['p99_ms'])} ms, max {common.fmt(base['max_ms'])} ms")
    rows = [[c.name, c.value if c.value is not None else "-", f"<= {common.fmt(c.limit)} {c.unit}", c.verdict]
            for c in checks]
    common.print_table(["floor", "measured", "target", "verdict"], rows, title="Floors (informational)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats and short windows (a smoke run)")
    parser.add_argument("--models", nargs="+", default=list(common.LIGHT_MODELS), help="light models for latency")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 20, quick 3)")
    parser.add_argument("--layers", type=int, default=1000, help="length of the Add chain")
    parser.add_argument("--lag-seconds", type=float, default=None, help="loop-lag window (default 3, quick 0.5)")
    common.add_engine_args(parser, "*.json")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 20)
    lag_seconds = args.lag_seconds or (0.5 if args.quick else 3.0)

    lat = latency.run(args.models, repeats=repeats, threads=args.threads)
    latency.print_report(lat)
    ovh = overhead.run(layers=args.layers, repeats=max(repeats, 5), lag_seconds=lag_seconds,
                       threads=args.threads)
    overhead.print_report(ovh)
    checks = floors(lat, ovh)
    print_summary(lat, ovh, checks)
    if not args.no_write:
        for name, data in (("latency", lat), ("overhead", ovh)):
            common.write_results(name, data)
        path = common.write_results("run_all", {"floors": [c.to_dict() for c in checks],
                                                "latency": lat, "overhead": ovh})
        print(f"\nwrote {path} (and latency.json, overhead.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
