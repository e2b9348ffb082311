"""``write_atomically``: a reader sees the old file or the whole new one, and nothing is left
behind when a write fails."""
from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer.files import write_atomically


def test_writes_bytes_and_text_and_replaces_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomically(path, b"\x00\x01old")
    assert path.read_bytes() == b"\x00\x01old"
    write_atomically(path, "nouveau é")
    assert path.read_text(encoding="utf-8") == "nouveau é"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    write_atomically(path, b"old")
    with pytest.raises(TypeError):
        write_atomically(path, 12345)  # type: ignore[arg-type]  # (not bytes: the write raises)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.bin"]


def test_a_missing_folder_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        write_atomically(tmp_path / "absent" / "file", b"data")
    assert list(tmp_path.iterdir()) == []


def test_the_file_gets_a_plain_opens_mode(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    atomic = tmp_path / "atomic"
    write_atomically(atomic, b"")
    assert atomic.stat().st_mode == plain.stat().st_mode  # (readable by whom the umask allows, as before)
