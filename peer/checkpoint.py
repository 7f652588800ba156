"""Durable checkpoints of a peer: written atomically, the last K kept, loaded without unpickling code.

A checkpoint is a dict of tensors and plain values (model and optimizer state dicts, the round)
saved with torch.save to `round-<r>.pt`: first to a temporary file in the same directory, flushed
and fsynced, then renamed over the final name and the directory fsynced, so a crash leaves either
the old checkpoint or the new one, never half of one. Loading uses `weights_only=True`: a file that
would need arbitrary code to unpickle is refused, and a damaged file is skipped for an older one.
"""

import os
import re
import tempfile
from pathlib import Path

import torch

NAME = re.compile(r"^round-(\d{1,12})\.pt$")


class CheckpointStore:
    """Checkpoints of one peer in `directory`; keeps the newest `keep`."""

    def __init__(self, directory: str | Path, *, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)

    def rounds(self) -> list[int]:
        """Rounds that have a checkpoint, oldest first."""
        found = (NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def last_saved(self) -> float | None:
        """Unix time the newest checkpoint was written (its file's mtime), None if there is none."""
        rounds = self.rounds()
        try:
            return (self.directory / f"round-{rounds[-1]}.pt").stat().st_mtime if rounds else None
        except OSError:  # pruned or replaced meanwhile
            return None

    def save(self, round_number: int, state: dict) -> Path:
        """Writes the checkpoint of `round_number` atomically and prunes the oldest beyond `keep`."""
        if round_number < 0:
            raise ValueError(f"round must be >= 0, got {round_number}")
        target = self.directory / f"round-{round_number}.pt"
        descriptor, temporary = tempfile.mkstemp(dir=self.directory, prefix=".round-", suffix=".tmp")
        try:
            with os.fdopen(descriptor, "wb") as file:
                torch.save({"round": round_number, **state}, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        self._fsync_directory()
        for old in self.rounds()[: -self.keep]:
            (self.directory / f"round-{old}.pt").unlink(missing_ok=True)
        return target

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict | None:
        """The newest checkpoint that loads safely, or None; damaged or unsafe files are skipped."""
        for round_number in reversed(self.rounds()):
            path = self.directory / f"round-{round_number}.pt"
            try:
                state = torch.load(path, map_location=map_location, weights_only=True)
            except Exception:  # torch raises many types for truncated, corrupt or code-carrying files
                continue
            if isinstance(state, dict) and state.get("round") == round_number:
                return state
        return None

    def _fsync_directory(self) -> None:
        descriptor = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
