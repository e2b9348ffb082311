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
- numba's runtime (NRT), which numba compiles from LLVM IR in every process (60-100 ms, and
  20-30 MB of LLVM's own code paged in to optimise it), is compiled once and kept as machine code
  beside the kernels' caches, under a name of the numba, llvmlite and CPU that compiled it
  (`start_runtime`);
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

import contextlib
import hashlib
import pickle
import threading
from pathlib import Path
from typing import Any

import llvmlite
import llvmlite.binding as llvm
import numba
from numba.core import caching, codegen, config
from numba.core.compiler_lock import global_compiler_lock
from numba.core.runtime import _nrt_python, nrtdynmod, rtsys

from ...files import write_atomically

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
        start_runtime(target_context)
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


# -- numba's runtime as machine code ----------------------------------------------------------------
#: The runtime's cache file, in the folder numba caches asyncinfer's kernels in; ``key`` hashes
#: the numba, llvmlite and CPU (the codegen's triple, name and features) that compiled it.
RUNTIME_FILE = "numba-runtime-{key}.nbo"
_DIGEST_BYTES = hashlib.sha256().digest_size
# numba's choice of cache folder: its cache implementation's locators (``_CacheImpl`` in older numba)
_LOCATORS: Any = getattr(getattr(caching, "CacheImpl", getattr(caching, "_CacheImpl", None)), "_locator_classes",
                         None)


def _runtime_path(context: Any) -> Path | None:
    """Where the runtime's machine code for ``context``'s codegen is cached: numba's cache folder
    for this module's functions (``NUMBA_CACHE_DIR``, the package's ``__pycache__`` where it is
    writable, the user's cache), or None where numba would not cache there."""
    key = repr((numba.__version__, llvmlite.__version__, context.codegen().magic_tuple()))
    for locator_class in _LOCATORS:
        locator = locator_class.from_function(start_runtime, __file__)
        if locator is not None:
            name = RUNTIME_FILE.format(key=hashlib.sha256(key.encode()).hexdigest()[:16])
            return Path(locator.get_cache_path()) / name
    return None


def _load_runtime(context: Any, path: Path) -> Any:
    """The runtime's code library from ``path``, or None where it is missing, not whole (its
    digest is checked before anything is unpickled) or needs a symbol this process lacks (LLVM
    would abort on it)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    digest, payload = data[:_DIGEST_BYTES], data[_DIGEST_BYTES:]
    if hashlib.sha256(payload).digest() != digest:
        return None
    state = pickle.loads(payload)
    engine = context.codegen()._engine
    if not (state[1] == "object" and len(state[2]) == 4 and _resolvable(engine, state[2][3])):
        return None
    return context.codegen().unserialize_library(state)


def _compile_runtime(context: Any, path: Path | None) -> Any:
    """The runtime's code library compiled as numba compiles it, its machine code kept, and
    written to ``path`` (atomically; a folder that refuses is left alone)."""
    module, library = nrtdynmod.create_nrt_module(context)
    library.add_ir_module(module)
    library.enable_object_caching()
    library.finalize()
    if path is None:
        return library
    _ours.saving = True  # (serialized with the names it defines and uses, as a kernel of ours)
    try:
        payload = pickle.dumps(library.serialize_using_object_code(), protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        _ours.saving = False
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, hashlib.sha256(payload).digest() + payload)
    return library


def start_runtime(context: Any) -> None:
    """Start numba's runtime (NRT) for ``context``'s codegen, as ``rtsys.initialize`` does, with
    its functions loaded as machine code where an earlier process compiled them (`RUNTIME_FILE`),
    else compiled and kept there. Where the runtime has started, or numba's is not laid out as
    expected, ``rtsys.initialize`` does what it does."""
    laid_out = (getattr(rtsys, "_init", None) is False and hasattr(_nrt_python, "c_helpers")
                and hasattr(nrtdynmod, "create_nrt_module") and _LOCATORS is not None)
    if not (laid_out and keep_bitcode_unparsed()):
        rtsys.initialize(context)
        return
    with global_compiler_lock:
        if rtsys._init:
            return
        if config.NRT_STATS:
            _nrt_python.memsys_enable_stats()
        for name, address in _nrt_python.c_helpers.items():  # (the C functions its code calls)
            llvm.add_symbol(name if name.startswith("_") else "NRT_" + name, address)
        path = _runtime_path(context)
        library = _load_runtime(context, path) if path is not None else None
        rtsys._library = library if library is not None else _compile_runtime(context, path)
        rtsys._init = True
