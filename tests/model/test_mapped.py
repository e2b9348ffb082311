"""External weights memory-mapped from the model's file, and their pages handed back once a
kernel keeps a packed form of them (`asyncinfer.model.mapped`)."""
from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer.model.mapped import release_resident_pages

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"),
    reason="reads a mapping's resident size from /proc/self/smaps (Linux only)")


def _resident_bytes(array: np.ndarray) -> int:
    """The resident size of the mapping holding ``array``'s first byte (/proc/self/smaps' Rss)."""
    address = array.ctypes.data
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the array")


def _matmul_model(tmp_path: Path, w: np.ndarray, rows: int) -> Path:
    """``y = x @ w``, w external at an offset that is not a multiple of the page size."""
    pad = np.zeros(100, np.float32)  # the weight starts 400 bytes into the file
    (tmp_path / "weights.bin").write_bytes(pad.tobytes() + w.tobytes())
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=list(w.shape))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in {"location": "weights.bin", "offset": str(pad.nbytes), "length": str(w.nbytes)}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mapped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, w.shape[1]])], [tensor])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_released_pages_leave_the_process_and_read_back_the_same(tmp_path):
    w = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    model = ai.load_model(_matmul_model(tmp_path, w, 4))
    mapped = model.constants["w"]
    assert float(mapped.sum()) == pytest.approx(float(w.sum()), rel=1e-4)  # every page read in
    assert _resident_bytes(mapped) >= w.nbytes - mmap.PAGESIZE

    released = release_resident_pages(mapped)

    page = mmap.PAGESIZE  # every page wholly inside the weight: not the ones it shares at its ends
    assert w.nbytes - 2 * page <= released <= w.nbytes and released % page == 0
    assert _resident_bytes(mapped) <= 2 * page
    np.testing.assert_array_equal(mapped, w)  # read again from the file: the same bytes


def test_arrays_not_mapped_from_a_file_are_left_alone():
    own = np.ones((1024, 1024), np.float32)
    assert release_resident_pages(own) == 0
    assert release_resident_pages(own[:, :10]) == 0
    np.testing.assert_array_equal(own, 1.0)


def test_weights_packed_for_the_gemm_are_resident_once(tmp_path):
    # 64 rows: the panel GEMM, which packs a constant weight at the first run and reads only the
    # packed copy after. The mapped original's pages go back to the page cache once it is packed.
    rng = np.random.default_rng(1)
    w = rng.standard_normal((512, 1024)).astype(np.float32)
    model = ai.load_model(_matmul_model(tmp_path, w, 64))
    mapped = model.constants["w"]
    x = rng.standard_normal((64, 512)).astype(np.float32)
    expected = x.astype(np.float64) @ w.astype(np.float64)
    with ai.Worker(model, "cpu") as worker:
        for _ in range(2):
            np.testing.assert_allclose(worker.run_blocking({"x": x})["y"], expected, rtol=1e-4, atol=1e-3)
            assert _resident_bytes(mapped) <= 2 * mmap.PAGESIZE
    np.testing.assert_array_equal(mapped, w)
