"""The command line, including the README's demo command."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from asyncinfer import assets
from asyncinfer.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[0].splitlines()
    assert len(commands) == 2
    assert commands[0].endswith("asyncinfer demo")
    assert "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_demo_command_as_the_readme_runs_it():
    # The README's first command ends in `asyncinfer demo`: run the installed console script when
    # this environment has one (as the README's virtual environment does), else the module.
    script = Path(sys.executable).with_name("asyncinfer")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "asyncinfer"]
    proc = subprocess.run(command + ["demo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"accuracy: ([\d.]+)%", proc.stdout).group(1))
    assert accuracy >= 95.0
    assert re.search(r"latency \(batch 1\): p50 [\d.]+ ms, p99 [\d.]+ ms", proc.stdout)
    assert re.search(r"throughput \(batch 32, concurrent\): [\d,]+ images/s", proc.stdout)
    assert "360/360" in proc.stderr  # the progress bars, one final line each off a terminal


def test_demo_draws_a_progress_bar(capsys):
    assert main(["demo"]) == 0
    err = capsys.readouterr().err
    assert "latency    [" in err and "360/360" in err


def test_run_with_random_inputs(capsys, tmp_path):
    out = tmp_path / "out.npz"
    assert main(["run", str(assets.default_model_path()), "--random", "--dim", "N=3", "--save", str(out)]) == 0
    text = capsys.readouterr().out
    assert "probabilities: float32[3, 10]" in text
    with np.load(out) as saved:
        np.testing.assert_allclose(saved["probabilities"].sum(axis=1), 1, rtol=1e-5)


def test_run_with_input_file(capsys, tmp_path, digits_samples):
    images, _ = digits_samples
    path = tmp_path / "x.npy"
    np.save(path, images[:2])
    assert main(["run", str(assets.default_model_path()), "--input", f"image={path}"]) == 0
    assert "logits: float32[2, 10]" in capsys.readouterr().out


def test_run_with_profile_writes_a_trace_and_prints_the_summary(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    argv = ["run", str(assets.default_model_path()), "--random", "--warmup", "--profile", str(trace)]
    assert main(argv + ["--value", "relu1", "--value", "probabilities"]) == 0
    text = capsys.readouterr().out
    assert "relu1: float32[1, 16, 8, 8]" in text and "probabilities: float32[1, 10]" in text
    assert "Conv+Relu" in text and "1 run(s), 7 steps" in text and str(trace) in text
    slices = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in slices) == sorted(["conv1", "conv2", "pool", "flatten", "fc1", "fc2", "softmax"])
    assert main(["run", str(assets.default_model_path()), "--random", "--value", "conv1"]) == 2
    assert "fused" in capsys.readouterr().err


def test_run_reports_errors_cleanly(capsys, tmp_path):
    assert main(["run", str(assets.default_model_path())]) == 2
    assert "input 'image' not given" in capsys.readouterr().err
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    assert main(["run", str(bad), "--random"]) == 2
    assert "ModelLoadError" in capsys.readouterr().err


def test_info_lists_inputs_outputs_ops_and_backends(capsys):
    assert main(["info", str(assets.default_model_path())]) == 0
    text = capsys.readouterr().out
    assert "image: float32 ['N', 1, 8, 8]" in text
    assert re.search(r"Conv\s+2\s+cpu", text)
    assert "probabilities" in text


def test_info_on_a_light_model(capsys):
    path = Path(onnx.__file__).parent / "backend/test/data/light/light_resnet50.onnx"
    if not path.exists():
        pytest.skip("onnx package ships no light models in this version")
    assert main(["info", str(path)]) == 0
    assert re.search(r"ConstantOfShape\s+239\s+cpu", capsys.readouterr().out)


def test_readback_modes_example_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "readback_modes.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for mode in ("awaited:", "polled:", "callback:      success = True", "blocking:", "to array:",
                 "from backend:", "np.asarray:", "concurrent:", "kept after dispose: (1, 10)"):
        assert mode in proc.stdout


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "99999"],
    ["serve", "--port", "http"],
    ["serve", "--max-delay-ms", "-1"],
    ["serve", "--max-batch-size", "0"],
    ["demo", "--batch-size", "0"],
])
def test_out_of_range_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["run", str(assets.default_model_path()), "--random", "--save", "{missing}/out.npz"],
    ["operators", "--output", "{missing}/operators.md"],
    ["conformance", "--filter", "^test_abs$", "--write-passing", "{missing}/passing.txt"],
])
def test_unwritable_output_files_are_clean_errors(argv, capsys, tmp_path):
    argv = [a.format(missing=tmp_path / "no" / "such" / "dir") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncinfer: error:") and "No such file or directory" in err
