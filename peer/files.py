"""Files written whole: checkpoints, the round clock, a join address, Prometheus targets.

One way to write them (`write_atomically`): a temporary file beside the target, renamed over it, so
that a reader, or a peer restarting after a crash, sees the old content or the new, never half.
"""

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: str | Path, write: Callable[[BinaryIO], object], *, durable: bool = False) -> None:
    """`write` fills a temporary file beside `path`, which is then renamed over `path`. `durable`: the
    file is fsynced before the rename and its folder after it, so the new content also survives a power
    cut. Creates the folder. A failure removes the temporary file and leaves `path` as it was; raises
    OSError (or what `write` raised)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):  # a folder made read-only keeps it: the cause is the error
            Path(temporary).unlink(missing_ok=True)
        raise
    if durable:
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def replace_text(path: str | Path, text: str, *, durable: bool = False) -> None:
    """`text` written to `path` whole (`write_atomically`)."""
    write_atomically(path, lambda file: file.write(text.encode()), durable=durable)
