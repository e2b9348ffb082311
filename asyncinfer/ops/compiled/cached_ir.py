"""What a kernel loaded from numba's on-disk cache costs in memory: its bitcode, parsed on demand.

numba caches a kernel as its machine code plus its LLVM IR as bitcode. At load it parses that
bitcode into an LLVM module (about 14x the bitcode's size), reads from it the names of the
symbols the kernel defines (which it must know to call the code), and keeps the module in case a
function compiled later in the process calls the kernel and links it in. An engine that loads
its kernels from the cache and compiles nothing new never uses the module, yet such modules were
most of a worker's memory beyond its weights: the spin team's serve loop, which links every
kernel that splits across the team, holds 2.5 MB of bitcode, 36 MB parsed (0.19 s to parse); a
first run of MobileNetV3-small left 80 MB of them resident.

`keep_bitcode_unparsed` changes two things in numba's code library, and nothing in the code run:

- a kernel compiled by this process is cached with the names of the symbols it defines beside
  its bitcode, so a later process loads it without parsing anything;
- a loaded kernel keeps its bitcode as bytes, and parses it the first time a later compile links
  against it (a new caller still inlines it). A cache written without the names (by numba before
  this was installed) is parsed as numba does and the module dropped at once.

numba's cache index is tied to numba's version, so a cache of this layout is never read by
another numba, and where numba's code library is not laid out as expected nothing is installed.
"""
from __future__ import annotations

from typing import Any

import llvmlite.binding as llvm
from numba.core import codegen

_LIBRARY: Any = codegen.CPUCodeLibrary
_METHODS = ("_unserialize", "_get_module_for_linking", "serialize_using_object_code", "enable_object_caching",
            "_set_compiled_object", "_finalize_final_module")


def defined_names(module: Any) -> tuple[str, ...]:
    """The functions and globals an LLVM module defines (what numba's engine records at a load)."""
    return tuple(value.name for values in (module.functions, module.global_variables)
                 for value in values if not value.is_declaration)


def keep_bitcode_unparsed() -> bool:
    """Install the lean cache loads (once per process; a later call does nothing); whether they
    are in place. Where numba's code library is not laid out as this module expects (another
    numba version), nothing changes and the answer is False."""
    if getattr(_LIBRARY, "_asyncinfer_keeps_bitcode", False):
        return True
    if not all(hasattr(_LIBRARY, name) for name in _METHODS):
        return False
    load = _LIBRARY._unserialize.__func__
    serialize = _LIBRARY.serialize_using_object_code
    module_for_linking = _LIBRARY._get_module_for_linking

    def serialize_using_object_code(self: Any) -> Any:
        name, kind, data = serialize(self)
        if kind != "object" or len(data) != 2:
            return name, kind, data
        return name, kind, (*data, defined_names(self._get_module_for_linking()))

    def _unserialize(cls: Any, codegen_: Any, state: Any) -> Any:
        name, kind, data = state
        symbols = getattr(codegen_._engine, "_defined_symbols", None)
        if kind == "object" and len(data) == 3 and isinstance(symbols, set):
            object_code, bitcode, names = data
            library = codegen_.create_library(name)
            library.enable_object_caching()
            library._set_compiled_object(object_code)
            library._finalize_final_module()
            symbols.update(names)  # (numba's own load parses the bitcode for these names)
            library._asyncinfer_bitcode = bitcode
            return library
        if kind == "object" and len(data) == 3:  # (an engine without the names' set: numba's way)
            state = (name, kind, data[:2])
        library = load(cls, codegen_, state)
        if kind == "object" and getattr(library, "_shared_module", None) is not None:
            library._shared_module = None  # llvmlite disposes of the module with its last reference
            library._asyncinfer_bitcode = data[1]
        return library

    def _get_module_for_linking(self: Any) -> Any:
        bitcode = self.__dict__.pop("_asyncinfer_bitcode", None)
        if bitcode is not None and self._shared_module is None:
            self._shared_module = llvm.parse_bitcode(bitcode)
        return module_for_linking(self)

    _LIBRARY.serialize_using_object_code = serialize_using_object_code
    _LIBRARY._unserialize = classmethod(_unserialize)
    _LIBRARY._get_module_for_linking = _get_module_for_linking
    _LIBRARY._asyncinfer_keeps_bitcode = True
    return True
