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

_PROGRAM = """
import sys, numba
sys.path.insert(0, {folder!r})
from asyncinfer.ops.compiled import cached_ir
assert cached_ir.keep_bitcode_unparsed()
import kernels
assert kernels.inner(2.0) == 5.0
library = kernels.inner.overloads[kernels.inner.signatures[0]].library
print("loaded" if library._shared_module is None and "_asyncinfer_bitcode" in library.__dict__ else "compiled")

@numba.njit
def outer(x):  # (compiled here, not cached: it links inner's library, whose IR was kept as bytes)
    return kernels.inner(x) * 10.0

assert outer(2.0) == 50.0, outer(2.0)
assert "_asyncinfer_bitcode" not in library.__dict__ and library._shared_module is not None  # (parsed back)
print("linked")
"""


def test_a_kernel_loaded_from_the_cache_still_links_into_a_new_caller(tmp_path):
    (tmp_path / "kernels.py").write_text(_KERNELS)
    program = textwrap.dedent(_PROGRAM).format(folder=str(tmp_path))
    env_cache = {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    seen = []
    for _ in range(2):  # the first process compiles and caches inner, the second loads it
        proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **env_cache})
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen.append(proc.stdout.split())
    assert seen == [["compiled", "linked"], ["loaded", "linked"]]
