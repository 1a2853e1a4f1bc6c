"""Write a file so that a crash leaves either the old file or the new one, never a torn one."""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    mode: int = 0o644,
    before_rename: Callable[[], None] | None = None,  # fault injection: a crash lands here
) -> Path:
    """Temp file in the same directory, fsync, rename over ``path``, fsync the directory.

    The temp name is unique per call (mkstemp), so two writers, or a restarted container
    whose process has the same pid, never share it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, mode)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path
