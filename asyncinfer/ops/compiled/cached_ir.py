"""What a kernel loaded from numba's on-disk cache keeps in memory: its bitcode, parsed on demand.

numba loads a cached kernel as its machine code plus its LLVM IR as bitcode, and keeps that IR
*parsed* (an LLVM module, about 14x the bitcode's size) in case a function compiled later in the
process calls the kernel and needs it for linking. An engine that loads its kernels from the
cache and compiles nothing new never uses it, yet it was most of a worker's memory beyond the
weights: the spin team's serve loop, which links every kernel that splits across the team, holds
2.5 MB of bitcode, 36 MB parsed. A first run of MobileNetV3-small grew the process by 263 MB at
peak with numba's loads, 140 MB with these (SSDLite 325 / 162 MB, the Llama block 303 / 212).

`keep_bitcode_unparsed` makes numba's cache loads keep the bitcode bytes instead, and parse them
back the first time a later compile links against the kernel: the same code runs and a new
caller still inlines it. numba parses the bitcode at load to learn the symbols the kernel defines
(the parse is needed, the keeping is not), so a large module's parse is freed at once and its
pages handed back to the system (``malloc_trim``; glibc keeps freed small blocks otherwise).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Any

import llvmlite.binding as llvm
from numba.core import codegen

#: A parse freed from a bitcode this large hands its pages back (one ``malloc_trim``, ~4 ms on a
#: 200 MB heap): below it, the freed blocks are reused by the next kernels' parses.
TRIM_AFTER_BITCODE_BYTES = 1 << 20

_LIBRARY: Any = codegen.CPUCodeLibrary
_METHODS = ("_unserialize", "_get_module_for_linking")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (returns free heap pages to the system), where the C library has it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc.malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError, TypeError):
        return None


def keep_bitcode_unparsed() -> bool:
    """Install the lean cache loads (once per process; a later call does nothing); whether they
    are in place. Where numba's code library is not laid out as this module expects (another
    numba version), nothing changes and the answer is False: numba keeps its parsed modules."""
    if getattr(_LIBRARY, "_asyncinfer_keeps_bitcode", False):
        return True
    if not all(hasattr(_LIBRARY, name) for name in _METHODS):
        return False
    load = _LIBRARY._unserialize.__func__
    module_for_linking = _LIBRARY._get_module_for_linking
    trim = _malloc_trim()

    def _unserialize(cls: Any, codegen_: Any, state: Any) -> Any:
        library = load(cls, codegen_, state)
        _name, kind, data = state
        if kind == "object" and isinstance(data, tuple) and len(data) == 2 \
                and getattr(library, "_shared_module", None) is not None:
            library._shared_module = None  # llvmlite disposes of the module with its last reference
            library._asyncinfer_bitcode = data[1]
            if trim is not None and len(data[1]) >= TRIM_AFTER_BITCODE_BYTES:
                trim(0)
        return library

    def _get_module_for_linking(self: Any) -> Any:
        bitcode = self.__dict__.pop("_asyncinfer_bitcode", None)
        if bitcode is not None and self._shared_module is None:
            self._shared_module = llvm.parse_bitcode(bitcode)
        return module_for_linking(self)

    _LIBRARY._unserialize = classmethod(_unserialize)
    _LIBRARY._get_module_for_linking = _get_module_for_linking
    _LIBRARY._asyncinfer_keeps_bitcode = True
    return True
