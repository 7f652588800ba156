"""Small files other programs read while we write them (a join address, Prometheus targets)."""

from pathlib import Path


def replace_text(path: str | Path, text: str) -> None:
    """Writes `text` to `path` whole: a temporary file beside it, renamed over it, so that a reader
    sees the old content or the new, never half. Creates the folder; raises OSError."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text(text)
    temporary.replace(target)
