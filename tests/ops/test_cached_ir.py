"""A kernel loaded from numba's cache keeps its IR as bitcode, parsed only when a later compile
links against it, and loads without numba's target refreshed (asyncinfer/ops/compiled/cached_ir.py):
the same machine code runs, a new caller still links, the parsed module (about 14x the bitcode) is
not kept, no registry module is imported unless the kernel uses a symbol only one adds, other
functions' caches stay readable by numba without asyncinfer, and numba's runtime is compiled once
and loaded as machine code after."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from numba.core import codegen

from asyncinfer.ops.compiled import cached_ir


def test_installed_with_the_compiled_kernels():
    assert cached_ir.keep_bitcode_unparsed()  # (already in place: importing the kernels installed it)
    assert codegen.CPUCodeLibrary._asyncinfer_keeps_bitcode


_KERNELS = """
import numba
import numpy as np

@numba.njit(cache=True)
def inner(x):
    return 2.0 * x + 1.0

@numba.njit(cache=True)
def allocating(n):  # (its machine code calls numba's runtime to allocate: NRT_MemInfo_alloc_aligned)
    return np.arange(n).sum()
"""

# Run twice on one cache folder: the first process compiles and caches inner, the second loads it.
# ``numba_as_is``: the process leaves numba's code library alone (a cache written by plain numba).
_PROGRAM = """
import sys, numba, llvmlite.binding as llvm
sys.path.insert(0, {folder!r})
if {numba_as_is!r}:
    from numba.core import codegen
    codegen.CPUCodeLibrary._asyncinfer_keeps_bitcode = True  # (install() then leaves numba as it is)
from asyncinfer.ops.compiled import cached_ir
cached_ir.keep_bitcode_unparsed()
cached_ir.PACKAGES = ("kernels",)
parses = []
parse = llvm.parse_bitcode
llvm.parse_bitcode = lambda data: parses.append(len(data)) or parse(data)
import kernels
assert kernels.inner(2.0) == 5.0
library = kernels.inner.overloads[kernels.inner.signatures[0]].library
loaded = "_asyncinfer_bitcode" in library.__dict__ and library._shared_module is None
print("loaded" if loaded else "compiled", "parsed" if parses else "unparsed")

@numba.njit
def outer(x):  # (compiled here, not cached: it links inner's library, whose IR was kept as bytes)
    return kernels.inner(x) * 10.0

assert outer(2.0) == 50.0, outer(2.0)
assert "_asyncinfer_bitcode" not in library.__dict__ and library._shared_module is not None
print("linked")
"""


def _in_processes(program: str, cache, runs: list[dict]) -> list[list[str]]:
    """``program`` formatted with each of ``runs`` in turn, each in a process of its own on the
    numba cache folder ``cache``: the words each printed."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    seen = []
    for fields in runs:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(program).format(**fields)], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen.append(proc.stdout.split())
    return seen


def _twice(folder, numba_as_is_first: bool) -> list[list[str]]:
    runs = [{"folder": str(folder), "numba_as_is": numba_as_is} for numba_as_is in (numba_as_is_first, False)]
    return _in_processes(_PROGRAM, folder / f"cache-{numba_as_is_first}", runs)


def test_a_cached_kernel_loads_without_a_parse_and_still_links_into_a_new_caller(tmp_path):
    (tmp_path / "kernels.py").write_text(_KERNELS)
    # (the second process loads inner with the names of its symbols beside its bitcode: nothing to parse)
    assert _twice(tmp_path, numba_as_is_first=False) == [["compiled", "unparsed", "linked"],
                                                         ["loaded", "unparsed", "linked"]]


def test_a_cache_written_by_plain_numba_loads_parsed_and_is_not_kept(tmp_path):
    (tmp_path / "kernels.py").write_text(_KERNELS)
    # (numba's cache layout: the bitcode is parsed for its symbols' names, then only the bytes kept)
    assert _twice(tmp_path, numba_as_is_first=True) == [["compiled", "unparsed", "linked"],
                                                        ["loaded", "parsed", "linked"]]


# A second process loads both kernels: ``inner`` uses no symbol a refresh of numba's target adds,
# and loads without one (numba's refreshes counted); ``allocating`` is loaded as though numba's
# runtime allocator were missing (hidden from the check): the target is refreshed first, as
# numba's own load does, and the kernel runs.
_LOADS = """
import sys, llvmlite.binding as llvm
from numba.core import base
sys.path.insert(0, {folder!r})
from asyncinfer.ops.compiled import cached_ir
cached_ir.PACKAGES = ("kernels",)
refreshes = []
refresh = base.BaseContext.refresh
base.BaseContext.refresh = lambda self: refreshes.append(1) or refresh(self)
if {hide!r}:
    find = llvm.address_of_symbol
    llvm.address_of_symbol = lambda name: 0 if name == "NRT_MemInfo_alloc_aligned" else find(name)
import kernels
assert kernels.inner(2.0) == 5.0
print("refreshed" if refreshes else "not-refreshed")
assert kernels.allocating(5) == 10
print("refreshed" if refreshes else "not-refreshed")
"""


def test_a_cached_kernel_loads_without_numbas_target_refreshed_unless_a_symbol_is_missing(tmp_path):
    (tmp_path / "kernels.py").write_text(_KERNELS)
    runs = [{"folder": str(tmp_path), "hide": hide} for hide in (False, False, True)]  # (compiles, loads, hidden)
    seen = _in_processes(_LOADS, tmp_path / "cache", runs)
    assert seen == [["refreshed", "refreshed"],  # (a compile refreshes numba's target)
                    ["not-refreshed", "not-refreshed"],
                    ["not-refreshed", "refreshed"]]


# numba's runtime (NRT) started for a kernel of ours loaded from the cache: compiled (numba's
# LLVM module built) only where no earlier process left its machine code, or where that file is
# damaged; ``allocating`` calls the runtime, so a runtime loaded wrong would not give 10.
_RUNTIME = """
import sys
from numba.core.runtime import nrtdynmod
sys.path.insert(0, {folder!r})
from asyncinfer.ops.compiled import cached_ir
cached_ir.PACKAGES = ("kernels",)
builds = []
create = nrtdynmod.create_nrt_module
nrtdynmod.create_nrt_module = lambda context: builds.append(1) or create(context)
import kernels
assert kernels.allocating(5) == 10
print("runtime-compiled" if builds else "runtime-loaded")
"""


def test_numbas_runtime_is_compiled_once_then_loaded_and_a_damaged_copy_is_compiled_again(tmp_path):
    (tmp_path / "kernels.py").write_text(_KERNELS)
    cache = tmp_path / "cache"
    runs = [{"folder": str(tmp_path)}] * 2
    # (the first process compiles the kernels and the runtime, caching both; the second loads them)
    assert _in_processes(_RUNTIME, cache, runs) == [["runtime-compiled"], ["runtime-loaded"]]
    [saved] = cache.rglob(cached_ir.RUNTIME_FILE.format(key="*"))
    data = bytearray(saved.read_bytes())
    data[-100] ^= 0xFF  # (one byte of it changed: the digest no longer matches)
    saved.write_bytes(bytes(data))
    assert _in_processes(_RUNTIME, cache, runs) == [["runtime-compiled"], ["runtime-loaded"]]


# A function of another package (a user's own) cached in a process that imported asyncinfer is
# cached as numba caches it: a process without asyncinfer loads it.
_USER = """
import sys
sys.path.insert(0, {folder!r})
if {with_asyncinfer!r}:
    import asyncinfer.ops.compiled  # noqa: F401 (installs cached_ir)
import kernels
assert kernels.inner(2.0) == 5.0
print("asyncinfer" if "asyncinfer" in sys.modules else "plain",
      "cached" if sum(kernels.inner.stats.cache_hits.values()) else "compiled")
"""


def test_another_packages_cache_written_beside_asyncinfer_loads_in_plain_numba(tmp_path):
    (tmp_path / "kernels.py").write_text(_KERNELS)
    runs = [{"folder": str(tmp_path), "with_asyncinfer": with_asyncinfer} for with_asyncinfer in (True, False)]
    seen = _in_processes(_USER, tmp_path / "cache", runs)
    assert seen == [["asyncinfer", "compiled"], ["plain", "cached"]]


# A process's first run of a model, its kernels in the cache: the embedded digits CNN, and
# MobileNetV3-small's last depthwise block (576 channels at 7x7, 5x5: a loop whose plan sizes its
# scratch with a compiled helper's formula, called from Python). Run twice on the suite's own
# kernel cache: the first process compiles what the cache lacks, the second must compile nothing
# (a compiled helper called from Python is compiled for that call in every process: 0.4 s of a
# first run) and refresh nothing.
_FIRST_RUN = """
import numpy as np, onnx
from numba.core import base, dispatcher
from onnx import TensorProto, helper, numpy_helper
compiles, refreshes = [], []
compile_core = dispatcher._FunctionCompiler._compile_core
dispatcher._FunctionCompiler._compile_core = (
    lambda self, *a: compiles.append(self.py_func.__qualname__) or compile_core(self, *a))
refresh = base.BaseContext.refresh
base.BaseContext.refresh = lambda self: refreshes.append(1) or refresh(self)
import asyncinfer as ai
from asyncinfer.assets import default_model_path

rng = np.random.default_rng(0)
weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name) for name, shape in
           (("dw", (576, 1, 5, 5)), ("pw", (96, 576, 1, 1)))]
block = helper.make_model(helper.make_graph(
    [helper.make_node("Conv", ["x", "dw"], ["d"], group=576, pads=[2, 2, 2, 2]),
     helper.make_node("HardSwish", ["d"], ["h"]), helper.make_node("Conv", ["h", "pw"], ["y"])],
    "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 576, 7, 7])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], weights),
    opset_imports=[helper.make_opsetid("", 17)])
for model, x in ((default_model_path(), None), (block.SerializeToString(), rng.standard_normal((1, 576, 7, 7)))):
    loaded = ai.load_model(model)
    if x is None:
        x = np.zeros([d if isinstance(d, int) else 1 for d in loaded.inputs[0].shape], np.float32)
    with ai.Worker(loaded, "cpu", threads=2) as worker:
        worker.run_blocking({loaded.inputs[0].name: x.astype(np.float32)})
print(len(compiles), len(refreshes), *compiles)
"""


def test_a_first_run_with_its_kernels_cached_compiles_nothing_and_refreshes_nothing():
    seen = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _FIRST_RUN], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen.append(proc.stdout.split())
    assert seen[1] == ["0", "0"], seen[1]
