"""Files written so that a concurrent reader sees the old file or the whole new one, never a part.

Kernel caches, trace files and the serving supervisor's state are read by other processes while
this one writes them: each is written to a temporary file in the same folder, then renamed over
the old one (``os.replace``, atomic within a file system).
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_atomically(path: Path, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file beside it, then rename
    it over ``path``. Raises ``OSError`` where the folder refuses, leaving no temporary file.
    The file gets the mode a plain ``open`` gives (0o666 less the umask)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # unique per writer
    handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(payload)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
