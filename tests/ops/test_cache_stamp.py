"""Numba's cached kernels are dropped when any kernel source changed (asyncinfer/ops/compiled/cache_stamp.py):
numba checks a cached function against its own file only, so a kernel inlining another file's
would otherwise keep that file's old code."""
from __future__ import annotations

from pathlib import Path

from asyncinfer.ops.compiled import cache_stamp


def _tree(tmp_path: Path) -> tuple[list[Path], Path, Path]:
    sources = [tmp_path / "panels.py", tmp_path / "team_parts.py"]
    for i, path in enumerate(sources):
        path.write_text(f"def kernel_{i}(): pass\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    return sources, cache, cache / cache_stamp.STAMP_NAME


def _cached(cache: Path) -> list[str]:
    """Fake cache files of two kernels, beside a byte-code file that must stay."""
    names = ["team_parts.serve_parts-40.py311.nbi", "team_parts.serve_parts-40.py311.1.nbc", "panels.cpython-311.pyc"]
    for name in names:
        (cache / name).write_bytes(b"x")
    return names


def test_caches_go_when_a_source_changes_and_stay_while_none_does(tmp_path):
    sources, cache, stamp = _tree(tmp_path)
    _cached(cache)
    assert cache_stamp.drop_stale_caches(sources, [cache], stamp)  # (no stamp yet: nothing says they are current)
    assert sorted(p.name for p in cache.iterdir()) == sorted(["panels.cpython-311.pyc", stamp.name])
    _cached(cache)  # (compiled again by the next calls)
    assert not cache_stamp.drop_stale_caches(sources, [cache], stamp)
    assert len(list(cache.glob("*.nb[ic]"))) == 2
    sources[0].write_text("def kernel_0(): return 1\n")  # an inlined kernel's file edited
    assert cache_stamp.drop_stale_caches(sources, [cache], stamp)
    assert not list(cache.glob("*.nb[ic]")) and (cache / "panels.cpython-311.pyc").exists()
    assert stamp.read_text().strip() == cache_stamp.sources_digest(sources)


def test_a_file_system_that_refuses_is_left_alone(tmp_path):
    sources, cache, _ = _tree(tmp_path)
    _cached(cache)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert not cache_stamp.drop_stale_caches(sources, [cache], blocker / "cannot" / "stamp")
    missing = [tmp_path / "gone.py"]  # (a source that cannot be read: no hash, nothing dropped)
    assert not cache_stamp.drop_stale_caches(missing, [cache], cache / "stamp")
    assert len(list(cache.glob("*.nb[ic]"))) == 2


def test_the_kernels_sources_and_a_moved_cache(monkeypatch):
    names = {path.name for path in cache_stamp.kernel_sources()}
    assert {"team_parts.py", "panels.py", "spin_team.py", "holding_gil.py", "cache_stamp.py"} <= names
    assert all(path.is_file() for path in cache_stamp.kernel_sources())
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/nonexistent")  # (numba's own directory: its owner clears it)
    assert cache_stamp.refresh() is False
