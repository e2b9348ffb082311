"""A/B of two source trees of asyncinfer on the same models, in two processes taking turns.

The machines this runs on drift: on the 2-core VM a model's own time moves up to 1.7x within
minutes, far more than most changes are worth, so one benchmark run of the old code and one of
the new one prove nothing. Here each tree runs in a child process of its own that loads the
models once and keeps its worker; the parent asks each child in turn for a block of runs (the
order alternating round by round), so both trees see the machine's phases alike, and compares
the medians::

    git worktree add /tmp/start <commit>
    python3 bench/ab_trees.py --old /tmp/start mobilenet_v3_small squeezenet
    python3 bench/ab_trees.py --old /tmp/start --mode await --rounds 24 --runs 8 resnet18

A model is a light-zoo name (``bench/common.py``), a real architecture (``bench/architectures.py``,
built and cached on first use) or ``add_chain_N``, `bench overhead`'s chain of N tiny ``Add``
layers (per-layer cost). Both children take the models, their inputs and this script from
the new tree (``--new``, by default this checkout); only ``asyncinfer`` comes from each tree.
Prints one row per model: the medians and p10s of each tree, ``new / old``. Writes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent


def _child(tree: str, name: str, mode: str, threads: int) -> None:
    """Serve blocks of runs of model ``name`` with the asyncinfer of ``tree``: read a count per
    line on stdin, answer with the JSON list of that many run times (seconds)."""
    sys.path.insert(0, tree)
    import asyncinfer as ai  # noqa: PLC0415 - the tree's, before the bench modules' root is added
    sys.path.remove(tree)
    sys.path.insert(0, str(REPO_ROOT))
    import asyncio  # noqa: PLC0415

    from bench import architectures, common, overhead  # noqa: PLC0415

    if name.startswith("add_chain_"):  # `bench overhead`'s chain of tiny Adds: per-layer cost
        layers = int(name.removeprefix("add_chain_"))
        model, inputs = ai.load_model(overhead.add_chain_model(layers)), overhead.add_chain_inputs()
    elif name in architectures.ARCHITECTURES:
        model = ai.load_model(str(architectures.model_path(name)))
        inputs = architectures.ARCHITECTURES[name].inputs()
    else:
        proto = common.load_light_model(name)
        model, inputs = ai.load_model(proto), common.standard_inputs(proto, batch=1)
    worker = ai.Worker(model, "cpu", threads=threads)
    loop = asyncio.new_event_loop()

    async def awaited(count: int) -> list[float]:
        times = []
        for _ in range(count):
            start = time.perf_counter()
            await worker.run(dict(inputs))
            times.append(time.perf_counter() - start)
        return times

    def blocking(count: int) -> list[float]:
        times = []
        for _ in range(count):
            start = time.perf_counter()
            worker.run_blocking(dict(inputs))
            times.append(time.perf_counter() - start)
        return times

    def run(count: int) -> list[float]:
        return loop.run_until_complete(awaited(count)) if mode == "await" else blocking(count)

    run(5)  # warm: kernels compiled, buffers made, the run mode chosen
    print("ready", flush=True)
    for line in sys.stdin:
        run(1)  # untimed: the first run after the other tree's block
        print(json.dumps(run(int(line))), flush=True)


def compare(old: str, new: str, name: str, *, mode: str = "block", rounds: int = 16, runs: int = 6,
            threads: int = 2) -> dict[str, float]:
    """Medians and p10s (ms) of ``name``'s runs under the asyncinfer of trees ``old`` and
    ``new``, taking turns in blocks of ``runs`` for ``rounds`` rounds, and ``new / old``."""
    trees = {"old": old, "new": new}
    commands = {label: [sys.executable, __file__, "--child", tree, "--mode", mode, "--threads", str(threads), name]
                for label, tree in trees.items()}
    # a throwaway child of each tree first: a tree just edited has its kernel caches dropped
    # (`compiled.cache_stamp`), and a process that compiled its kernels ran 5-7% slower than one
    # that loaded them (MobileNetV3-small, the same code in two trees: 1.073, then 0.984)
    for command in commands.values():
        subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
    children = {label: subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for label, command in commands.items()}
    try:
        for label, child in children.items():
            if child.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError(f"the {label} tree's child did not start (see its error above)")
        samples: dict[str, list[float]] = {label: [] for label in children}
        for r in range(rounds):
            for label in (("old", "new") if r % 2 else ("new", "old")):
                child = children[label]
                child.stdin.write(f"{runs}\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
                samples[label] += json.loads(child.stdout.readline())  # type: ignore[union-attr]
    finally:
        for child in children.values():
            child.stdin.close()  # type: ignore[union-attr]
            child.wait(timeout=60)
    figures = {}
    for label, times in samples.items():
        figures[f"{label}_ms"] = float(np.median(times)) * 1e3
        figures[f"{label}_p10_ms"] = float(np.percentile(times, 10)) * 1e3
    figures["new_over_old"] = figures["new_ms"] / figures["old_ms"]
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="light-zoo or real-architecture names, or add_chain_N")
    parser.add_argument("--old", help="the old tree (a checkout or a git worktree)")
    parser.add_argument("--new", default=str(REPO_ROOT), help="the new tree (default: this checkout)")
    parser.add_argument("--mode", choices=("block", "await"), default="block",
                        help="run_blocking, or `await worker.run` on an event loop")
    parser.add_argument("--rounds", type=int, default=16, help="blocks of runs of each tree, in turns")
    parser.add_argument("--runs", type=int, default=6, help="timed runs a block")
    parser.add_argument("--threads", type=int, default=2, help="threads of each worker")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.models[0], args.mode, args.threads)
        return 0
    if not args.old:
        parser.error("--old is required")
    for tree in (args.old, args.new):
        if not (Path(tree) / "asyncinfer" / "__init__.py").is_file():
            parser.error(f"{tree} holds no asyncinfer package")
    print(f"{'model':24s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'p10 old':>9s} {'p10 new':>9s}  "
          f"({args.mode}, {args.rounds} rounds of {args.runs} runs, {args.threads} threads)")
    for name in args.models:
        f = compare(os.path.abspath(args.old), os.path.abspath(args.new), name, mode=args.mode,
                    rounds=args.rounds, runs=args.runs, threads=args.threads)
        print(f"{name:24s} {f['old_ms']:9.3f} {f['new_ms']:9.3f} {f['new_over_old']:8.3f} "
              f"{f['old_p10_ms']:9.3f} {f['new_p10_ms']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
