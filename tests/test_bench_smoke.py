"""Smoke test of the benchmarks: the runner (``python -m bench``) lists, runs, skips and records
failures, and every measurement runs with tiny sizes and returns sane numbers.

No timing assertions: the machines are shared and noisy; performance lives in bench/.
"""
from __future__ import annotations

import importlib
import inspect
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `bench` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from bench import common, concurrency, latency, overhead, runner  # noqa: E402

TIMING_KEYS = {"median_ms", "p10_ms", "p90_ms", "min_ms", "max_ms", "n"}


def assert_positive(value: object) -> None:
    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, value


def assert_timing(timing: dict, n: int) -> None:
    assert set(timing) == TIMING_KEYS
    assert timing["n"] == n
    for key in TIMING_KEYS - {"n"}:
        assert_positive(timing[key])
    assert timing["min_ms"] <= timing["p10_ms"] <= timing["median_ms"] <= timing["p90_ms"] <= timing["max_ms"]


def assert_lag(result: dict) -> None:
    assert result["ticks"] > 0
    for key in ("p50_ms", "p99_ms", "max_ms"):
        assert math.isfinite(result[key]) and result[key] >= 0  # a wake-up can be right on time


# -- common ------------------------------------------------------------------------------------------
def test_standard_input_follows_backend_test_convention():
    x = common.standard_input([2, 3])
    assert x.dtype == np.float32 and x.shape == (2, 3)
    np.testing.assert_allclose(x.ravel(), np.arange(6) / 6, rtol=1e-6)


def test_light_models_are_found():
    for name in common.LIGHT_MODELS:
        assert common.light_model_path(name).is_file()
    with pytest.raises(FileNotFoundError, match="available"):
        common.light_model_path("no_such_model")


def test_geomean_and_timing_summary():
    assert common.geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert math.isnan(common.geomean([]))
    t = common.Timing.from_seconds([0.001, 0.002, 0.003])
    assert t.median_ms == pytest.approx(2.0) and t.n == 3


def test_time_interleaved_mixes_sync_and_async():
    calls: list[str] = []

    async def async_fn():
        calls.append("a")

    timings = common.time_interleaved({"sync": lambda: calls.append("s"), "async": async_fn}, repeats=2, warmup=1)
    # per contestant: 1 warm-up + one block (1 untimed call after the pause + 2 timed)
    assert set(timings) == {"sync", "async"} and calls.count("a") == calls.count("s") == 4
    assert all(t.n == 2 for t in timings.values())


def test_write_results(tmp_path):
    path = common.write_results("smoke", {"ratio": 1.5, "bad": float("nan"), "x": np.float32(2)}, tmp_path)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "smoke" and data["results"] == {"ratio": 1.5, "bad": None, "x": 2.0}
    assert "python" in data["environment"]


# -- overhead ----------------------------------------------------------------------------------------
def test_add_chain_keeps_every_layer():
    import asyncinfer as ai

    model = ai.load_model(overhead.add_chain_model(20))
    assert len(model.layers) == 20  # the optimizer must not collapse the chain


def test_schedule_time_on_add_chain():
    result = overhead.measure_schedule(overhead.add_chain_model(20), overhead.add_chain_inputs(),
                                       repeats=2, warmup=1)
    assert result["layers"] == 20
    assert_timing(result["schedule"], 2)
    assert_timing(result["run"], 2)
    assert_positive(result["ratio"])


def test_loop_lag_baseline_and_under_load():
    assert_lag(overhead.measure_loop_lag(None, seconds=0.2))
    loaded = overhead.measure_loop_lag(overhead.add_chain_model(20), overhead.add_chain_inputs(), seconds=0.2)
    assert_lag(loaded)
    assert loaded["model_runs"] > 0


def test_per_layer_overhead():
    pytest.importorskip("onnxruntime", reason="the per-layer benchmark compares against onnxruntime")
    result = overhead.measure_per_layer(20, repeats=2, warmup=1)
    assert set(result["us_per_layer"]) == {"asyncinfer_await", "asyncinfer_blocking", "ort"}
    for name, timing in result["timings"].items():
        assert_timing(timing, 2)
        assert_positive(result["us_per_layer"][name])


# -- latency and the summary ------------------------------------------------------------------------
def test_latency_on_squeezenet():
    pytest.importorskip("onnxruntime", reason="the latency benchmark compares against onnxruntime")
    result = latency.run(["squeezenet"], repeats=2, warmup=1, verbose=False)
    r = result["models"]["squeezenet"]
    assert "error" not in r, r.get("error")
    assert set(r["timings"]) == set(latency.CONTESTANTS)
    for timing in r["timings"].values():
        assert_timing(timing, 2)
    assert_positive(r["ratio_await"])
    assert_positive(r["ratio_blocking"])
    assert result["measured"] == 1
    assert result["geomean_ratio_await"] == pytest.approx(r["ratio_await"])


def test_ab_trees_runs_each_tree_in_its_own_process(capsys):
    """Two children take turns on one model (here both this checkout); each tree's medians and
    the ratio come back, and a tree without asyncinfer is refused before anything starts."""
    from bench import ab_trees

    figures = ab_trees.compare(str(REPO_ROOT), str(REPO_ROOT), "squeezenet", rounds=2, runs=1, threads=1)
    for key in ("old_ms", "new_ms", "old_p10_ms", "new_p10_ms", "new_over_old"):
        assert_positive(figures[key])
    assert figures["new_over_old"] == pytest.approx(figures["new_ms"] / figures["old_ms"])
    with pytest.raises(SystemExit):
        ab_trees.main(["--old", str(REPO_ROOT / "bench"), "squeezenet"])
    assert "holds no asyncinfer package" in capsys.readouterr().err


def test_latency_key_figures_are_its_geomeans():
    result = {"geomean_ratio_await": 1.5, "geomean_ratio_blocking": 1.4, "geomean_ratio_best": 1.3, "measured": 2}
    assert latency.key_figures(result) == {"await/ORT": 1.5, "blocking/ORT": 1.4, "best/best": 1.3, "models": 2}


def test_floors_report_every_target_of_the_benchmarks_that_ran():
    lat = {"geomean_ratio_await": 1.5, "geomean_ratio_blocking": 1.4, "measured": 1}
    ovh = {"model": "m", "chain": "chain",
           "per_layer": {"us_per_layer": {"asyncinfer_await": 60.0}},
           "loop_lag": {"m": {"error": "did not load"}},
           "schedule": {"chain": {"ratio": 0.2}, "m": {"ratio": 0.01}}}
    verdicts = {f.name: f.verdict for f in runner.floors({"latency": lat, "overhead": ovh})}
    # latency 1.5 > 1.2, 60 µs a layer, a 0.2 schedule share: MISS; lag and fixed cost not measured
    assert sorted(verdicts.values()) == ["MISS", "MISS", "MISS", "N/A", "N/A", "PASS"]
    assert [f.verdict for f in runner.floors({"latency": {**lat, "geomean_ratio_await": 1.1}})] == ["PASS"]
    ovh["fixed_cost"] = {"timings": {"asyncinfer_await": {"median_ms": 0.12}}}
    assert runner.floors({"overhead": ovh})[1].verdict == "PASS"  # 120 µs
    real = {"geomean_ratio": 1.4, "models": {"a": {"ratio": 1.1}, "b": {"ratio": 3.5}, "c": {"error": "x"}}}
    assert [(f.value, f.verdict) for f in runner.floors({"real_models": real})] == [(1.4, "PASS"), (3.5, "MISS")]
    assert runner.floors({"pixel": {}}) == []


def test_ort_tools_floors():
    ok = {"networks": {"resnet18": {"variants": {"float16": {"float16_over_fp32": 0.9}}}}, "failed": [], "measured": 3}
    assert [(f.value, f.verdict) for f in runner.floors({"ort_tools": ok})] == [(0.0, "PASS"), (0.9, "PASS")]
    bad = {"networks": {"bert_base": {"variants": {}}}, "failed": ["bert_base/dynamic"], "measured": 2}
    assert [(f.value, f.verdict) for f in runner.floors({"ort_tools": bad})] == [(1.0, "MISS")]
    nothing = {"networks": {}, "failed": [], "measured": 0}
    assert [f.verdict for f in runner.floors({"ort_tools": nothing})] == ["N/A"]


def test_load_time_floors_and_external_copy(monkeypatch, tmp_path):
    import asyncinfer as ai
    from bench import architectures, load_time

    result = {"models": {"m": {"load_ratio": 0.5, "rss_run_x_model": {"asyncinfer": 1.6},
                               "first_after_warmup_x_steady": 1.1}, "broken": {"error": "no"}}}
    assert [f.verdict for f in runner.floors({"load_time": result})] == ["PASS", "MISS", "PASS"]
    # the external-data copy of a cached model: model.onnx + one weights file, same values
    monkeypatch.setenv("ASYNCINFER_BENCH_CACHE", str(tmp_path))
    path = load_time.external_copy("lstm_vad")
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "weights.bin"]
    inline = ai.load_model(architectures.model_path("lstm_vad"))
    external = ai.load_model(path)
    for name, value in inline.constants.items():
        np.testing.assert_array_equal(external.constants[name], value)


def test_contention_on_squeezenet():
    pytest.importorskip("onnxruntime", reason="the contention benchmark compares against onnxruntime")
    from bench import contention

    if (reason := contention.unavailable_reason()) is not None:
        pytest.skip(reason)
    result = contention.run(["squeezenet"], seconds=0.1, rounds=1, verbose=False)
    r = result["models"]["squeezenet"]
    assert "error" not in r, r.get("error")
    assert result["busy_cores"] >= 1
    for engine in r["engines"].values():
        for case in ("alone", "busy"):
            assert engine[case]["runs"] >= 1
            assert 0 < engine[case]["median_ms"] <= engine[case]["max_ms"]
        assert engine["slowdown"] == pytest.approx(engine["busy"]["median_ms"] / engine["alone"]["median_ms"])
    assert r["ratio_busy"] == pytest.approx(r["engines"]["asyncinfer"]["busy"]["median_ms"]
                                            / r["engines"]["ort"]["busy"]["median_ms"])
    assert r["ratio_busy_await"] == pytest.approx(r["engines"]["asyncinfer_await"]["busy"]["median_ms"]
                                                  / r["engines"]["ort"]["busy"]["median_ms"])
    assert set(r["engines"]) == set(contention.ENGINES)
    assert set(contention.key_figures(result)) == {
        "squeezenet busy/alone asyncinfer", "squeezenet busy/alone asyncinfer_await", "squeezenet busy/alone ort",
        "squeezenet busy ai/ORT", "squeezenet busy ai await/ORT"}


def test_concurrency_floors_need_throughput_at_least_ort():
    fast = {"ratio": 1.2, "engines": {"asyncinfer": {"loop_lag": {"p99_ms": 3.0, "max_ms": 9.0}}}}
    conc = {"tasks": 8, "models": {"fast": fast, "slow": {"ratio": 0.5}, "broken": {"error": "did not load"}}}
    checks = runner.floors({"concurrency": conc})
    verdicts = {f.name: f.verdict for f in checks}
    assert verdicts["8-task throughput asyncinfer/ORT, fast"] == "PASS"  # higher is better
    assert verdicts["8-task throughput asyncinfer/ORT, slow"] == "MISS"
    assert verdicts["loop lag p99 while 8 tasks run, fast"] == "MISS"
    assert verdicts["loop lag max while 8 tasks run, fast"] == "PASS"
    assert sorted(verdicts.values()).count("N/A") == 5  # slow's lags and everything of broken
    assert checks[0].target == "≥ 1 x" and checks[1].target == "≤ 2 ms"


def test_concurrency_on_squeezenet():
    pytest.importorskip("onnxruntime", reason="the concurrency benchmark compares against onnxruntime")
    result = concurrency.run(["squeezenet"], tasks=2, seconds=0.2, rounds=2, repeats=1, verbose=False)
    r = result["models"]["squeezenet"]
    assert "error" not in r, r.get("error")
    assert set(r["engines"]) == set(concurrency.ENGINES)
    for engine in r["engines"].values():
        assert_positive(engine["runs_per_s"])
        assert len(engine["runs_per_s_blocks"]) == 2
        assert_timing(engine["single_request"], 1)
        assert_lag(engine["loop_lag"])
    blocks = [r["engines"][name]["runs_per_s_blocks"] for name in ("asyncinfer", "ort")]
    # ×ORT: the median of each round's two blocks' ratio (not the ratio of each engine's median)
    assert r["round_ratios"] == pytest.approx([ours / theirs for ours, theirs in zip(*blocks)])
    assert r["ratio"] == pytest.approx(sum(r["round_ratios"]) / 2)
    figures = concurrency.key_figures(result)
    assert list(figures) == ["squeezenet 2-task runs/s ×ORT", "squeezenet loop-lag p99 ms",
                             "squeezenet loop-lag max ms"]
    assert figures["squeezenet 2-task runs/s ×ORT"] == pytest.approx(r["ratio"])


def test_pixel_benchmark_on_squeezenet():
    pytest.importorskip("onnxruntime", reason="the pixel benchmark compares against onnxruntime")
    from pixel_testing import require_pixel

    require_pixel()
    from bench import pixel

    result = pixel.run(["squeezenet"], repeats=1, warmup=0, verbose=False)
    r = result["models"]["squeezenet"]
    assert "error" not in r, r.get("error")
    assert set(r["timings"]) == {"gpu_pixel", "cpu", "ort"}
    for timing in r["timings"].values():
        assert_timing(timing, 1)
    assert r["fallback_layers"] == 0 and r["transfers"] == 1  # the input's upload only
    assert_positive(r["ratio_pixel_cpu"])
    assert result["geomean_pixel_ort"] == pytest.approx(r["ratio_pixel_ort"])


# -- real_models -------------------------------------------------------------------------------------
def test_real_models_on_the_lstm_vad(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime", reason="the real_models benchmark compares against onnxruntime")
    from bench import architectures, real_models

    monkeypatch.setenv("ASYNCINFER_BENCH_CACHE", str(tmp_path))  # build into a fresh cache
    result = real_models.run(["lstm_vad"], repeats=2, warmup=1, verbose=False)
    r = result["models"]["lstm_vad"]
    assert "error" not in r, r.get("error")
    assert r["agreement"]["ok"], r["agreement"]["detail"]
    assert set(r["timings"]) == set(real_models.CONTESTANTS)
    for timing in r["timings"].values():
        assert_timing(timing, 2)
    for key in ("ratio", "ratio_executor", "ratio_best"):
        assert_positive(r[key])
    for engine in ("asyncinfer", "ort"):
        assert_positive(r["load_ms"][engine])
        assert_positive(r["first_run_ms"][engine])
    assert result["measured"] == 1 and result["mismatches"] == [] and "resnet18" in result["not_run"]
    assert result["geomean_ratio"] == pytest.approx(r["ratio"])
    assert [p.name for p in tmp_path.iterdir()] == [f"lstm_vad-{architectures.builder_key()}.onnx"]


def test_real_models_agreement_reports_disagreement():
    from bench import architectures, real_models

    arch = architectures.ARCHITECTURES["ssdlite_nms"]  # float outputs, and NMS indices compared by row
    ref = {"boxes": np.ones((1, 3, 4), np.float32), "selected_indices": np.array([[0, 0, 1], [0, 1, 2]], np.int64)}
    good = real_models.agreement(arch, {k: v.copy() for k, v in ref.items()}, ref)
    assert good["ok"] and good["detail"].startswith("ok")
    bad = real_models.agreement(arch, {"boxes": ref["boxes"] * 1.01, "selected_indices": ref["selected_indices"][:1]},
                                ref)
    assert not bad["ok"] and bad["detail"].startswith("MISMATCH")
    assert "boxes: rel. err 0.01" in bad["detail"] and "1 rows vs ORT 2" in bad["detail"]
    fp16 = real_models.agreement(arch, {"boxes": ref["boxes"].astype(np.float16),
                                        "selected_indices": ref["selected_indices"]}, ref)
    assert not fp16["ok"] and "dtype float16" in fp16["detail"]


def _tiny_networks():
    """A small residual CNN and a one-layer HF-style BERT, for the ort_tools benchmark."""
    from bench import architectures, ort_tools
    from bench.architectures import FLOAT, GraphBuilder

    def cnn():
        g = GraphBuilder("tiny_cnn", seed=9)
        x = g.input("input", FLOAT, [1, 3, 16, 16])
        y = g.op("Relu", g.conv(x, 3, 8, 3, 2))
        y = g.op("Add", y, g.op("Relu", g.conv(y, 8, 8, 3)))
        g.output(g.gemm(g.op("Flatten", g.op("GlobalAveragePool", y), axis=1), 8, 5), "logits", FLOAT, [1, 5])
        return g.model()

    def bert_feeds():
        rng = np.random.default_rng(1)
        mask = np.ones((1, 7), np.int64)
        mask[:, 5:] = 0
        return {"input_ids": rng.integers(0, 50, (1, 7)), "attention_mask": mask,
                "token_type_ids": np.zeros((1, 7), np.int64)}

    image = np.random.default_rng(2).standard_normal((1, 3, 16, 16), dtype=np.float32)
    return {"tiny_cnn": ort_tools.Network("tiny_cnn", cnn, lambda: {"input": image}, "cnn", "tiny CNN"),
            "tiny_bert": ort_tools.Network(
                "tiny_bert", lambda: architectures.bert_tiny(layers=1, hidden=32, heads=2, ffn=64, vocab=50,
                                                             max_positions=16, hf_mask=True),
                bert_feeds, "bert", "tiny BERT", heads=2, hidden=32)}


def test_ort_tools_on_tiny_networks(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime", reason="the ort_tools benchmark compares against onnxruntime")
    pytest.importorskip("sympy", reason="ORT's transformer optimizer needs sympy")
    from bench import ort_tools

    monkeypatch.setenv("ASYNCINFER_BENCH_CACHE", str(tmp_path))  # build into a fresh cache
    monkeypatch.setattr(ort_tools, "NETWORKS", _tiny_networks())
    variants = ["dynamic", "static_qop_channel", "static_qdq_tensor", "float16", "optimizer", "optimizer_dynamic",
                "ort_extended_dynamic"]
    result = ort_tools.run(["tiny_cnn", "tiny_bert"], variants, repeats=2, verbose=False)
    cnn, bert = (result["networks"][n]["variants"] for n in ("tiny_cnn", "tiny_bert"))
    # each network gets fp32 (the yardstick) and only the tools that apply to it
    assert set(cnn) == {"fp32", "dynamic", "static_qop_channel", "static_qdq_tensor", "float16",
                        "ort_extended_dynamic"}
    assert set(bert) == {"fp32", "dynamic", "float16", "optimizer", "optimizer_dynamic", "ort_extended_dynamic"}
    for network in (cnn, bert):
        for variant, r in network.items():
            assert "error" not in r, (variant, r.get("error"))
            assert r["agreement"]["ok"], (variant, r["agreement"]["detail"])
            assert_timing(r["timings"]["asyncinfer"], 2)
            assert_positive(r["ratio"])
    assert {"QGemm", "QLinearAdd"} <= set(cnn["static_qop_channel"]["com_microsoft_ops"])
    assert {"Attention", "SkipLayerNormalization"} <= set(bert["optimizer"]["com_microsoft_ops"])
    assert "QAttention" in bert["optimizer_dynamic"]["com_microsoft_ops"]
    assert_positive(cnn["float16"]["float16_over_fp32"])
    assert result["failed"] == [] and result["measured"] == len(cnn) + len(bert)
    cached = {p.name.split("-")[0] for p in (tmp_path / "ort_tools").iterdir()}
    assert cached == {"tiny_cnn", "tiny_bert"}


def test_ort_tools_reports_a_variant_that_fails(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime", reason="the ort_tools benchmark compares against onnxruntime")
    from bench import ort_tools

    monkeypatch.setenv("ASYNCINFER_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(ort_tools, "NETWORKS", _tiny_networks())

    def broken(src, dst):
        raise RuntimeError("the tool crashed")

    monkeypatch.setattr(ort_tools, "_float16", broken)
    result = ort_tools.run(["tiny_cnn"], ["float16"], repeats=2, verbose=False)
    variants = result["networks"]["tiny_cnn"]["variants"]
    assert "the tool crashed" in variants["float16"]["error"] and variants["fp32"]["agreement"]["ok"]
    assert result["failed"] == ["tiny_cnn/float16"]
    assert not list((tmp_path / "ort_tools").glob("*partial*"))  # nothing half-written is left to be found


def test_architecture_cache_rebuilds_when_the_builders_change(monkeypatch, tmp_path):
    from bench import architectures

    monkeypatch.setenv("ASYNCINFER_BENCH_CACHE", str(tmp_path))
    first = architectures.model_path("lstm_vad")
    assert architectures.model_path("lstm_vad") == first and first.parent == tmp_path
    monkeypatch.setattr(architectures, "BUILDER_VERSION", architectures.BUILDER_VERSION + 1)
    second = architectures.model_path("lstm_vad")
    assert second != first and second.is_file() and not first.exists()  # the stale build is gone


def test_small_architectures_are_valid_onnx():
    import onnx

    from bench import architectures

    for name, arch in architectures.ARCHITECTURES.items():
        if arch.large:  # seconds to build; the full benchmark run covers them
            continue
        proto = arch.build()
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
        names = {vi.name for vi in proto.graph.input}
        assert set(arch.inputs()) == names, name


def test_vit_builder_on_a_small_shape_agrees_with_the_reference():
    """ViT-B/16's builder (`bench load_time`'s large model) on a toy size: valid ONNX, and
    asyncinfer's run agrees with `onnx.reference` (the full size is built by the benchmark)."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    import asyncinfer as ai
    from bench import architectures

    proto = architectures.vit_b16(layers=2, hidden=32, heads=4, mlp=64, size=32, patch=8)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    image = architectures.image(2, size=32)
    [expected] = ReferenceEvaluator(proto).run(None, {"input": image})
    with ai.Worker(ai.load_model(proto.SerializeToString()), "cpu") as worker:
        got = worker.run_blocking({"input": image})["logits"]
    assert got.shape == (2, 1000)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_load_time_children_import_with_the_bytecode_cache_on(monkeypatch):
    from bench import load_time

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("ASYNCINFER_BENCH_PROBE", "kept")
    env = load_time._child_env()
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["ASYNCINFER_BENCH_PROBE"] == "kept"


# -- the runner: python -m bench ---------------------------------------------------------------------
def test_every_benchmark_offers_what_the_runner_calls():
    for name in runner.BENCHMARKS:
        module = importlib.import_module(f"bench.{name}")
        run_params = inspect.signature(module.run).parameters
        assert set(module.QUICK) <= set(run_params), f"{name}.QUICK names arguments run() lacks"
        for hook in ("print_report", "unavailable_reason", "key_figures", "main"):
            assert callable(getattr(module, hook)), f"bench/{name}.py has no {hook}()"


def test_list_names_every_benchmark():
    proc = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(maxsplit=1) for line in proc.stdout.splitlines())
    assert list(lines) == list(runner.BENCHMARKS)
    for name, description in lines.items():
        assert "cannot be imported" not in description, f"{name}: {description}"


def test_unknown_benchmark_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        runner.parse_args(["latency", "no_such_bench"])
    assert exit_info.value.code == 2 and "no_such_bench" in capsys.readouterr().err


def test_missing_dependency_skips_but_a_broken_own_import_raises(monkeypatch):
    def missing(name: str) -> None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", lambda _name: missing("cupy"))
    assert runner.load("gpu_compute") == (None, "needs cupy (not installed)")
    monkeypatch.setattr(importlib, "import_module", lambda _name: missing("asyncinfer.backends"))
    with pytest.raises(ModuleNotFoundError):
        runner.load("gpu_compute")


def _fake_benchmark(**hooks) -> types.SimpleNamespace:
    """A stand-in for a bench/<name>.py module: runs instantly, reports nothing."""
    defaults = {"__doc__": "A fake benchmark.", "QUICK": {"repeats": 1}, "unavailable_reason": lambda: None,
                "print_report": lambda result: None, "key_figures": lambda result: {"x/ORT": result["ratio"]}}
    return types.SimpleNamespace(**{**defaults, **hooks})


def test_runner_records_skips_and_errors_and_runs_the_rest(monkeypatch, tmp_path, capsys):
    calls = {}

    def run_ok(*, repeats: int = 20, threads: int | None = None) -> dict:
        calls.update(repeats=repeats, threads=threads)
        return {"ratio": 1.25}

    def run_broken(*, repeats: int = 20) -> dict:  # takes no threads: --threads is not passed
        raise RuntimeError("boom")

    fakes = {"broken": _fake_benchmark(run=run_broken),
             "absent": _fake_benchmark(run=run_ok, unavailable_reason=lambda: "no device here"),
             "fine": _fake_benchmark(run=run_ok)}
    monkeypatch.setattr(runner, "BENCHMARKS", tuple(fakes))
    monkeypatch.setattr(runner, "load", lambda name: (fakes[name], None))
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)

    status = runner.main(["--quick", "--threads", "1", "--no-write"])
    out = capsys.readouterr().out
    assert status == 1  # an error is reported in the exit status; the run still finished
    assert "| broken | error: RuntimeError: boom |" in out
    assert "| absent | skipped: no device here |" in out
    assert "| fine | ok | x/ORT 1.25 |" in out
    assert calls == {"repeats": 1, "threads": 1}  # the quick profile and --threads reached run()
    assert list(tmp_path.iterdir()) == []  # --no-write


def test_quick_overhead_run_writes_the_summary(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime", reason="the overhead benchmark compares against onnxruntime")
    # Tinier than the real quick profile: this is about the runner, not the numbers.
    monkeypatch.setattr(overhead, "QUICK", {"layers": 20, "repeats": 2, "lag_seconds": 0.1, "model": "squeezenet"})
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)

    assert runner.main(["overhead", "--quick"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overhead.json", "summary.json", "summary.md"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["environment"]["cpu_model"] and summary["environment"]["cpu_count"] >= 1
    [bench] = summary["results"]["benchmarks"]
    assert bench["name"] == "overhead" and bench["status"] == "ok", bench
    assert_positive(bench["figures"]["per-layer await/ORT"])
    floors = summary["results"]["floors"]
    assert len(floors) == 5 and {f["verdict"] for f in floors} <= {"PASS", "MISS"}
    markdown = (tmp_path / "summary.md").read_text()
    assert "| overhead | ok | per-layer await/ORT" in markdown and summary["environment"]["cpu_model"] in markdown


# -- generate: token streams against ORT loops ----------------------------------------------------------
def test_generate_on_the_small_decoders(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime", reason="the generate benchmark compares against onnxruntime")
    from bench import generate

    monkeypatch.setenv("ASYNCINFER_BENCH_CACHE", str(tmp_path))  # build into a fresh cache
    result = generate.run(["gpt2", "llama"], tokens=3, streams=2, rounds=1, small=True, verbose=False)
    for name in ("gpt2", "llama"):
        r = result["models"][name]
        assert "error" not in r, r.get("error")
        assert r["identical_tokens"]["asyncinfer"], r["identical_tokens"]  # solo = ORT's, and 2 streams = solo
        assert r["asyncinfer_streams_equal_solo"]
        engines = set(r["engines"]) | set(r["unavailable"])
        assert engines == set(generate.ENGINES) and {"asyncinfer", "ort_iobinding"} <= set(r["engines"])
        for engine in r["engines"].values():
            one, two = engine["one_stream"], engine["2_streams"]
            for value in (one["ttft_ms"], one["per_token_ms"], one["tokens_per_s"], two["aggregate_tokens_per_s"],
                          two["x_one_stream"]):
                assert_positive(value)
            assert_lag(two["loop_lag"])
        ratio = r["ratios"]["ort_iobinding"]["per_token"]
        assert ratio == pytest.approx(r["engines"]["asyncinfer"]["one_stream"]["per_token_ms"]
                                      / r["engines"]["ort_iobinding"]["one_stream"]["per_token_ms"])
    # the decoders were built once, each in its folder with the genai_config.json of its names
    folders = sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir())
    assert folders == ["generate-gpt2_small_test", "generate-llama_small_test"]
    for folder in tmp_path.iterdir():
        config = json.loads((folder / "genai_config.json").read_text())
        assert config["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    figures = generate.key_figures(result)
    assert figures["gpt2 ms/token ×ORT-iobinding"] == pytest.approx(result["models"]["gpt2"]["ratios"]["ort_iobinding"]
                                                                       ["per_token"])


def test_generate_floors_and_unequal_tokens_void_the_ratios():
    good = {"ratios": {"ort_iobinding": {"per_token": 1.1}}, "identical_tokens": {"asyncinfer": True, "ort": True},
            "engines": {"asyncinfer": {"8_streams": {"x_one_stream": 3.0, "loop_lag": {"p99_ms": 1.5}}}}}
    checks = runner.floors({"generate": {"streams": 8, "models": {"m": good, "broken": {"error": "no"}}}})
    verdicts = {f.name: f.verdict for f in checks}
    assert verdicts["generate m: ms/token, one stream, asyncinfer/ORT IO-binding loop"] == "PASS"
    assert verdicts["generate m: 8 streams' tokens/s, x one stream's"] == "MISS"  # at least 4x
    assert verdicts["generate m: loop lag p99 while 8 streams run"] == "PASS"
    assert verdicts["generate m: greedy tokens equal ORT's, and each of 8 streams its solo run"] == "PASS"
    assert sorted(v for k, v in verdicts.items() if "broken" in k) == ["N/A"] * 4
    from bench import generate

    engine = {"one_stream": {"per_token_ms": 20.0, "ttft_ms": 50.0}, "8_streams": {"aggregate_tokens_per_s": 200.0}}
    fast = {"one_stream": {"per_token_ms": 10.0, "ttft_ms": 25.0}, "8_streams": {"aggregate_tokens_per_s": 400.0}}
    engines = {"asyncinfer": engine, "ort_iobinding": fast, "ort_genai": fast}
    got = generate.ratios(engines, {"asyncinfer": True, "ort_iobinding": True, "ort_genai": False}, 8)
    assert got["ort_iobinding"] == {"per_token": 2.0, "ttft": 2.0, "aggregate_tokens_per_s": 0.5,
                                    "per_token_of_medians": 2.0, "ttft_of_medians": 2.0,
                                    "aggregate_tokens_per_s_of_medians": 0.5}
    assert set(got["ort_genai"].values()) == {None}


def test_generate_ratios_pair_each_round():
    """A ratio is the median of the rounds' own ratios: a slow spell of the machine that hits both
    engines in one round cancels, where the ratio of the medians would mix rounds."""
    from bench import generate

    def engine(per_token: list[float]) -> dict:
        return {"one_stream": {"per_token_ms": sorted(per_token)[1], "per_token_ms_rounds": per_token,
                               "ttft_ms": 1.0},
                "8_streams": {"aggregate_tokens_per_s": 1.0}}

    # round 2 ran slow for both; ours is 1.1x theirs in every round
    ours, theirs = engine([11.0, 22.0, 13.2]), engine([10.0, 20.0, 12.0])
    got = generate.ratios({"asyncinfer": ours, "ort_iobinding": theirs}, {"asyncinfer": True, "ort_iobinding": True},
                          8)["ort_iobinding"]
    assert got["per_token"] == pytest.approx(1.1)
    assert got["per_token_of_medians"] == pytest.approx(13.2 / 12.0)
    # pairing is by round: the same times in another order give other ratios
    shuffled = engine([13.2, 11.0, 22.0])
    got = generate.ratios({"asyncinfer": shuffled, "ort_iobinding": theirs},
                          {"asyncinfer": True, "ort_iobinding": True}, 8)["ort_iobinding"]
    assert got["per_token"] == pytest.approx(1.32)  # 1.32, 0.55, 1.83: the median
    assert got["per_token_of_medians"] == pytest.approx(13.2 / 12.0)


# -- serving_load: asyncinfer serve vs ORT behind FastAPI, over HTTP ---------------------------------
def test_serving_baseline_speaks_kserve_v2():
    pytest.importorskip("onnxruntime", reason="the baseline server runs onnxruntime")
    pytest.importorskip("fastapi", reason="the baseline server is a FastAPI app")
    import asyncio

    import httpx

    from asyncinfer import assets
    from bench import serving_baseline as sb

    session = sb._session(str(assets.default_model_path()), threads=1)
    x = assets.default_samples()[0][:2]
    expected = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"image": x})))
    body, headers = sb.encode_request({"image": x})  # binary tensor data both ways
    as_json = {"inputs": [{"name": "image", "shape": [2, 1, 8, 8], "datatype": "FP32", "data": x.ravel().tolist()}],
               "outputs": [{"name": "probabilities"}]}  # JSON both ways, one output asked for

    async def exchange() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=sb.build_app({"digits": session}))
        async with httpx.AsyncClient(transport=transport, base_url="http://baseline") as client:
            return [await client.get("/v2/health/ready"), await client.get("/v2/models/digits"),
                    await client.get("/v2/models/digits/config"),
                    await client.post("/v2/models/digits/infer", content=body, headers=headers),
                    await client.post("/v2/models/digits/infer", json=as_json),
                    await client.post("/v2/models/digits/infer", content=body[:-4], headers=headers),
                    await client.post("/v2/models/nope/infer", content=body, headers=headers)]

    ready, meta, config, binary, json_answer, short, unknown = asyncio.run(exchange())
    assert ready.status_code == 200
    assert meta.json()["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert config.json()["input"][0]["dims"] == [-1, 1, 8, 8]

    assert binary.status_code == 200 and sb.HEADER_LENGTH.lower() in binary.headers
    got = sb.decode_response(binary.content, binary.headers[sb.HEADER_LENGTH.lower()])
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want)

    assert json_answer.status_code == 200 and sb.HEADER_LENGTH.lower() not in json_answer.headers
    [output] = json_answer.json()["outputs"]
    assert output["name"] == "probabilities" and output["shape"] == [2, 10]
    np.testing.assert_allclose(output["data"], expected["probabilities"].ravel(), rtol=1e-6)

    assert short.status_code == 400 and "binary_data_size" in short.json()["error"]
    assert unknown.status_code == 404


def test_serving_load_stops_its_servers_on_an_exception():
    pytest.importorskip("fastapi", reason="the baseline server is a FastAPI app")
    from asyncinfer import assets
    from bench import serving_load

    with pytest.raises(RuntimeError, match="boom"):
        with serving_load.running_servers({"digits": assets.default_model_path()}, threads=1, kinds=["baseline"],
                                          verbose=False) as servers:
            proc = servers["baseline"].proc
            assert proc.poll() is None  # ready and running
            raise RuntimeError("boom")
    assert proc.poll() is not None  # stopped, not orphaned


def _assert_serving_load_result(result: dict, models: list[str], levels: list[int]) -> None:
    from bench import serving_load

    assert list(result["models"]) == models
    for name in models:
        r = result["models"][name]
        assert "error" not in r, r.get("error")
        assert r["agreement"]["ok"]  # every server, binary and JSON, agreed with the baseline
        assert set(r["agreement"]["max_abs_diff"]) == {f"{k} {enc}" for k in result["servers"]
                                                         for enc in ("binary", "json")}
        assert list(r["concurrency"]) == [str(level) for level in levels]
        for row in r["concurrency"].values():
            assert set(row) == set(result["servers"]) == set(serving_load.kinds_for(result["workers"]))
            for figures in row.values():
                assert figures["client"] == result["client"] and figures["errors"] == 0
                assert figures["requests"] > 0
                for key in ("infer_per_s", "p50_ms", "p99_ms", "throughput_vs_baseline", "p99_vs_baseline"):
                    assert_positive(figures[key])
                assert figures["p50_ms"] <= figures["p99_ms"]
            assert row["baseline"]["throughput_vs_baseline"] == pytest.approx(1.0)


def test_quick_serving_load_run_writes_its_results(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime", reason="the baseline server runs onnxruntime")
    pytest.importorskip("fastapi", reason="the baseline server is a FastAPI app")
    from bench import serving_load

    monkeypatch.setattr(serving_load, "find_perf_analyzer", lambda: None)  # the local client: no external tool
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert runner.main(["serving_load", "--quick"]) == 0
    result = json.loads((tmp_path / "serving_load.json").read_text())["results"]
    assert result["client"] == "local" and "perf_analyzer not found" in result["perf_analyzer_unused_because"]
    assert result["seconds_per_block"] == serving_load.QUICK["seconds"]
    _assert_serving_load_result(result, ["digits", "squeezenet"], list(serving_load.LEVELS))
    assert result["models"]["digits"]["batchable"] and not result["models"]["squeezenet"]["batchable"]
    summary = json.loads((tmp_path / "summary.json").read_text())["results"]
    [bench] = summary["benchmarks"]
    assert bench["status"] == "ok" and bench["figures"]["digits c8 infer/s ×base"] > 0
    # the c8 batching targets, for the model whose batch dimension is free only
    assert [f["name"].rsplit(", ", 1)[1] for f in summary["floors"]] == ["digits", "digits"]


def test_serving_load_with_perf_analyzer():
    pytest.importorskip("onnxruntime", reason="the baseline server runs onnxruntime")
    pytest.importorskip("fastapi", reason="the baseline server is a FastAPI app")
    from bench import serving_load

    problem = serving_load.perf_analyzer_problem(serving_load.find_perf_analyzer())
    if problem is not None:
        pytest.skip(f"{problem}")
    result = serving_load.run(["digits"], levels=[1, 2], seconds=0.3, warmup=0.1, rounds=1, client="perf_analyzer",
                              verbose=False)
    assert result["client"] == "perf_analyzer"
    _assert_serving_load_result(result, ["digits"], [1, 2])


def test_blocked_layout_prototype_agrees_with_numpy():
    """`bench/blocked_layout.py`'s NCHW16c prototype checks its result against NumPy's before it
    times it (two panels, a last block of positions overlapping the one before)."""
    from bench import blocked_layout

    _, w, x = blocked_layout.one_conv(32, 64, 5, np.random.default_rng(1))
    assert blocked_layout.time_blocked(w, x, repeats=1) > 0
