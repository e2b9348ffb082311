"""What a kernel loaded from numba's on-disk cache costs: its bitcode parsed on demand, and no
registry imported to load it.

numba caches a kernel as its machine code plus its LLVM IR as bitcode. At load it parses that
bitcode into an LLVM module (about 14x the bitcode's size), reads from it the names of the
symbols the kernel defines (which it must know to call the code), and keeps the module in case a
function compiled later in the process calls the kernel and links it in. An engine that loads
its kernels from the cache and compiles nothing new never uses the module, yet such modules were
most of a worker's memory beyond its weights: the spin team's serve loop, which links every
kernel that splits across the team, holds 2.5 MB of bitcode, 36 MB parsed (0.19 s to parse); a
first run of MobileNetV3-small left 80 MB of them resident.

And before its first load numba refreshes its CPU target: it imports every module of its own
that implements a function for compiled code, and through ``numba.np.linalg`` SciPy's linear
algebra where SciPy is installed, to have them ready for a compile. A process that only loads
cached kernels paid that in its first run: 0.4-0.7 s and 30 MB of peak memory (SciPy's BLAS
library among it). Loaded machine code needs none of it, only numba's runtime (NRT, whose
functions it calls) and the symbols it was linked against.

`keep_bitcode_unparsed` changes numba's code library and cache for asyncinfer's own kernels
(functions of the `PACKAGES`), and nothing in the code run:

- a kernel compiled by this process is cached with the names of the symbols it defines and of
  those it uses from outside beside its bitcode, so a later process loads it without parsing
  anything;
- a kernel loads with numba's runtime started, not its target refreshed: the refresh is done
  first only where a symbol the kernel uses is not there yet (one a refresh's import would add),
  and a compile refreshes the target as ever;
- a loaded kernel keeps its bitcode as bytes, and parses it the first time a later compile links
  against it (a new caller still inlines it). A cache written without the names (by numba before
  this was installed) is loaded as numba does (the target refreshed first) and the module dropped
  at once, for any function.

Other functions' caches are written as numba writes them, which a process without asyncinfer
reads too. numba's cache index is tied to numba's version, so a cache of this layout is never
read by another numba, and where numba's code library is not laid out as expected nothing is
installed.
"""
from __future__ import annotations

import threading
from typing import Any

import llvmlite.binding as llvm
from numba.core import caching, codegen
from numba.core.runtime import rtsys

#: The packages whose functions' caches take the lean layout and loads (`keep_bitcode_unparsed`).
PACKAGES: tuple[str, ...] = ("asyncinfer",)

_LIBRARY: Any = codegen.CPUCodeLibrary
_CACHE: Any = caching.Cache
_METHODS = ("_unserialize", "_get_module_for_linking", "serialize_using_object_code", "enable_object_caching",
            "_set_compiled_object", "_finalize_final_module")
_CACHE_METHODS = ("load_overload", "save_overload", "_load_overload", "_guard_against_spurious_io_errors")
# Declarations no symbol stands for: LLVM's intrinsics, and references numba links itself at a load
_NOT_SYMBOLS = ("llvm.", getattr(getattr(codegen, "RuntimeLinker", None), "PREFIX", ".numba.unresolved$"))

# This thread's cache at work on a function of the PACKAGES: ``saving`` it (its library is
# serialized with the names), or ``loading`` it into a target context not refreshed (that context)
_ours = threading.local()


def defined_names(module: Any) -> tuple[str, ...]:
    """The functions and globals an LLVM module defines (what numba's engine records at a load)."""
    return tuple(value.name for values in (module.functions, module.global_variables)
                 for value in values if not value.is_declaration)


def external_names(module: Any) -> tuple[str, ...]:
    """The symbols an LLVM module uses and does not define (numba's runtime, its C helpers, the C
    library, Python's C API): what its machine code needs resolved when it loads."""
    return tuple(value.name for values in (module.functions, module.global_variables)
                 for value in values if value.is_declaration and not value.name.startswith(_NOT_SYMBOLS))


def _resolvable(engine: Any, names: tuple[str, ...]) -> bool:
    """Whether each of ``names`` is defined in ``engine`` (a library loaded before, numba's
    runtime) or known to LLVM (this process's symbols, those numba added)."""
    defined = engine._defined_symbols
    return all(name in defined or llvm.address_of_symbol(name) for name in names)


def _of_packages(cache: Any) -> bool:
    """Whether ``cache`` (numba's, of one function) caches a function of the `PACKAGES`."""
    module = getattr(getattr(cache, "_py_func", None), "__module__", None) or ""
    return any(module == package or module.startswith(package + ".") for package in PACKAGES)


def keep_bitcode_unparsed() -> bool:
    """Install the lean cache loads (once per process; a later call does nothing); whether they
    are in place. Where numba's code library or cache is not laid out as this module expects
    (another numba version), nothing changes and the answer is False."""
    if getattr(_LIBRARY, "_asyncinfer_keeps_bitcode", False):
        return True
    if not (all(hasattr(_LIBRARY, name) for name in _METHODS) and all(hasattr(_CACHE, name) for name in _CACHE_METHODS)
            and hasattr(rtsys, "initialize") and hasattr(codegen, "JITCPUCodegen")):
        return False
    load = _LIBRARY._unserialize.__func__
    serialize = _LIBRARY.serialize_using_object_code
    module_for_linking = _LIBRARY._get_module_for_linking
    load_overload = _CACHE.load_overload
    save_overload = _CACHE.save_overload

    def serialize_using_object_code(self: Any) -> Any:
        name, kind, data = serialize(self)
        if kind != "object" or len(data) != 2 or not getattr(_ours, "saving", False):
            return name, kind, data
        return name, kind, (*data, defined_names(self._get_module_for_linking()), external_names(self._final_module))

    def _unserialize(cls: Any, codegen_: Any, state: Any) -> Any:
        name, kind, data = state
        symbols = getattr(codegen_._engine, "_defined_symbols", None)
        if kind == "object" and len(data) in (3, 4) and isinstance(symbols, set):
            object_code, bitcode, names = data[:3]
            if len(data) == 3 or not _resolvable(codegen_._engine, data[3]):
                _refresh_target()  # (a symbol one of numba's registry modules adds as it is imported)
            library = codegen_.create_library(name)
            library.enable_object_caching()
            library._set_compiled_object(object_code)
            library._finalize_final_module()
            symbols.update(names)  # (numba's own load parses the bitcode for these names)
            library._asyncinfer_bitcode = bitcode
            return library
        _refresh_target()
        if kind == "object" and len(data) > 2:  # (an engine without the names' set: numba's way)
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

    def lean_load_overload(self: Any, sig: Any, target_context: Any) -> Any:
        # numba's load refreshes the target first (see the module docstring); a kernel of ours
        # starts numba's runtime only, and `_unserialize` refreshes where a symbol is missing
        if not (_of_packages(self) and isinstance(target_context.codegen(), codegen.JITCPUCodegen)):
            return load_overload(self, sig, target_context)
        rtsys.initialize(target_context)
        _ours.loading = target_context
        try:
            with self._guard_against_spurious_io_errors():
                return self._load_overload(sig, target_context)
        finally:
            _ours.loading = None

    def lean_save_overload(self: Any, sig: Any, data: Any) -> Any:
        if not _of_packages(self):
            return save_overload(self, sig, data)
        _ours.saving = True
        try:
            return save_overload(self, sig, data)
        finally:
            _ours.saving = False

    _LIBRARY.serialize_using_object_code = serialize_using_object_code
    _LIBRARY._unserialize = classmethod(_unserialize)
    _LIBRARY._get_module_for_linking = _get_module_for_linking
    _CACHE.load_overload = lean_load_overload
    _CACHE.save_overload = lean_save_overload
    _LIBRARY._asyncinfer_keeps_bitcode = True
    return True


def _refresh_target() -> None:
    """Refresh the target context this thread loads a kernel of ours into without a refresh
    (what numba's load does first), once; nothing where none is loading."""
    context = getattr(_ours, "loading", None)
    if context is not None:
        _ours.loading = None
        context.refresh()
