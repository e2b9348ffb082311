"""A kernel loaded from numba's cache keeps its IR as bitcode, parsed only when a later compile
links against it (asyncinfer/ops/compiled/cached_ir.py): the same machine code runs, a new caller
still links, and the parsed module (about 14x the bitcode) is not kept."""
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

@numba.njit(cache=True)
def inner(x):
    return 2.0 * x + 1.0
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


def _twice(folder, numba_as_is_first: bool) -> list[list[str]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(folder / f"cache-{numba_as_is_first}")}
    seen = []
    for numba_as_is in (numba_as_is_first, False):
        program = textwrap.dedent(_PROGRAM).format(folder=str(folder), numba_as_is=numba_as_is)
        proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen.append(proc.stdout.split())
    return seen


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
