"""Numba's on-disk caches of asyncinfer's kernels, dropped when any kernel source changed.

numba checks a cached function against the file it is defined in, and only that file: a kernel
that inlines or calls kernels of other files (each `team_parts` runner runs a kind of part, a
`panels` register block sits inside a dozen kernels) keeps running the code those files had when
it was cached, after they changed. A source tree switched by ``git checkout`` or edited between
two runs then computes with a mix of old and new code, silently: an A/B of two worktrees once
measured a 0.92x "gain" against an old tree whose helpers still ran an experiment's kernels.

So at import the sources of every compiled kernel (this package and the two modules of
``concurrency`` with kernels of their own) are hashed, and where the hash differs from the one
stamped beside the caches, every cached kernel of asyncinfer is deleted before numba loads any:
the next calls compile afresh (about 1 s a kernel, once). An installed copy compares its files
with its own stamp; a fresh install or clone has no cache to drop. Where the cache directories
are not writable (numba then caches elsewhere, or not at all) nothing is done.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: The stamp's name, in the compiled package's ``__pycache__``.
STAMP_NAME = "kernels.sources"
_PACKAGE = Path(__file__).resolve().parent
_ROOT = _PACKAGE.parent.parent


def kernel_sources() -> list[Path]:
    """Every source file with numba kernels of asyncinfer's (or that such kernels inline)."""
    return sorted(_PACKAGE.glob("*.py")) + [_ROOT / "concurrency" / "spin_team.py",
                                           _ROOT / "concurrency" / "holding_gil.py"]


def sources_digest(sources: list[Path]) -> str:
    """One hash of the files' names and contents."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def drop_stale_caches(sources: list[Path], cache_dirs: list[Path], stamp: Path) -> bool:
    """Delete the numba cache files (``*.nbi``, ``*.nbc``) in ``cache_dirs`` unless ``stamp``
    holds the digest of ``sources``, then stamp it; whether any were deleted. Never raises for a
    file system that refuses (read-only installs: numba caches elsewhere, or not at all)."""
    try:
        digest = sources_digest(sources)
        if stamp.is_file() and stamp.read_text().strip() == digest:
            return False
        # the new stamp written first: where it cannot be, the caches stay (dropped at every
        # import, every process would compile every kernel again)
        stamp.parent.mkdir(exist_ok=True)
        partial = stamp.with_name(f"{stamp.name}.{os.getpid()}")
        partial.write_text(digest + "\n")
        dropped = False
        for folder in cache_dirs:
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.suffix in (".nbi", ".nbc"):
                    path.unlink(missing_ok=True)
                    dropped = True
        partial.replace(stamp)  # (atomic: a concurrent import reads the old stamp or the new one)
        return dropped
    except OSError:
        return False


def refresh() -> bool:
    """`drop_stale_caches` for asyncinfer's own kernels (unless ``NUMBA_CACHE_DIR`` moved the
    caches elsewhere: numba keys that directory by source path, and clearing it is its owner's)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return False
    folders = [_PACKAGE / "__pycache__", _ROOT / "concurrency" / "__pycache__"]
    return drop_stale_caches(kernel_sources(), folders, _PACKAGE / "__pycache__" / STAMP_NAME)
