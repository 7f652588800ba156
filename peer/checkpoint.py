"""Durable checkpoints of a peer: written atomically, the last K kept, never unpickled.

A checkpoint is a dict of tensors and plain values (model and optimizer state dicts, the round),
saved as one safetensors file, `round-<r>.safetensors`: every tensor under its path in the dict
(`model/blocks.0.norm1.weight`), and the dict itself, with its plain values, as JSON in the file's
metadata (`encode`; a dict is stored as its key-value pairs, so an optimizer state's integer keys come
back as integers). It is written first to a temporary file in the same directory, flushed and fsynced,
then renamed over the final name and the directory fsynced, so a crash leaves either the old
checkpoint or the new one, never half of one. Loading parses JSON and raw tensors: nothing in a
checkpoint can run code.

Faults a volunteer meets, and what the store does:
- a write that fails (folder made read-only, disk full) removes its temporary file and leaves the
  checkpoints already written as they were. It is a `CheckpointWriteError` naming the folder, or, for a
  store given `warn`, a warning and a count (`write_failures`): training goes on without that checkpoint,
  since the swarm holds the model too and a stopped peer would lose its part of every round after;
- a damaged newest checkpoint (torn, truncated, not a checkpoint, or holding another round) is reported
  by name and renamed to `round-<r>.safetensors.damaged`, so that it is never loaded again nor counted
  among the kept ones, and the next older one is loaded (`loaded_round` says which).
"""

import contextlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from shoal.peer.files import write_atomically

NAME = re.compile(r"^round-(\d{1,12})\.safetensors$")
SUFFIX = ".safetensors"
TREE_KEY = "shoal.checkpoint"
"""The metadata key holding the dict as JSON, tensors replaced by {"tensor": path}."""
DAMAGED_SUFFIX = ".damaged"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names the file, the cause and what is intact."""


class CheckpointStore:
    """Checkpoints of one peer in `directory`; keeps the newest `keep`.

    Args:
        directory: the folder of the checkpoints (created if missing).
        keep: how many of the newest checkpoints are kept; older ones are deleted after each save.
        warn: where the faults training survives are told, one line each: a write that failed (then
            `save` returns None instead of raising) and a damaged checkpoint set aside. None: a failed
            write raises CheckpointWriteError.
        meta: plain values written into every checkpoint, under "meta" (the model, the run).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 3,
        warn: Callable[[str], None] | None = None,
        meta: dict | None = None,
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.warn = warn
        self.meta = meta
        """Plain values every checkpoint holds under "meta": what the run trains (shoal export reads it)."""
        self.write_failures = 0
        """Saves that failed since the store was made (a Prometheus counter)."""
        self.last_write_failed = False
        """Whether the latest save failed (a stopping peer's last checkpoint was not written)."""
        self.loaded_round: int | None = None
        """The round of the checkpoint `load_latest` returned, None before one is loaded."""
        self._unreadable: set[int] = set()  # damaged, but could not be renamed: skipped all the same
        self.directory.mkdir(parents=True, exist_ok=True)

    def rounds(self) -> list[int]:
        """Rounds that have a checkpoint, oldest first; damaged ones set aside are not counted."""
        found = (NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m and int(m.group(1)) not in self._unreadable)

    def last_saved(self) -> float | None:
        """Unix time the newest checkpoint was written (its file's mtime), None if there is none."""
        rounds = self.rounds()
        try:
            return (self.directory / f"round-{rounds[-1]}{SUFFIX}").stat().st_mtime if rounds else None
        except OSError:  # pruned or replaced meanwhile
            return None

    def save(self, round_number: int, state: dict) -> Path | None:
        """Writes the checkpoint of `round_number` atomically and prunes the oldest beyond `keep`.
        Returns its path; if the write fails: CheckpointWriteError, or with `warn` a warning and None."""
        if round_number < 0:
            raise ValueError(f"round must be >= 0, got {round_number}")
        target = self.directory / f"round-{round_number}{SUFFIX}"
        try:
            meta = {} if self.meta is None else {"meta": self.meta}
            self._write(target, {"round": round_number, **meta, **state})
        except OSError as error:
            self.write_failures += 1
            self.last_write_failed = True
            rounds = self.rounds()
            intact = (
                f"round-{rounds[-1]}{SUFFIX} is the newest intact one" if rounds else "none written before"
            )
            failure = CheckpointWriteError(
                f"could not write the checkpoint {target.name} in {self.directory}: "
                f"{error.strerror or error} ({intact}): make the folder writable, or choose another "
                "--checkpoint-dir"
            )
            if self.warn is None:
                raise failure from None
            self.warn(f"{failure}; training goes on without this checkpoint")
            return None
        self.last_write_failed = False
        self._unreadable.discard(round_number)
        for old in self.rounds()[: -self.keep]:
            # an old checkpoint left over is harmless: the next save deletes it
            with contextlib.suppress(OSError):
                (self.directory / f"round-{old}{SUFFIX}").unlink(missing_ok=True)
        return target

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict | None:
        """The newest checkpoint that loads safely, or None. A damaged or unsafe one on the way is
        reported and set aside (renamed to `*.damaged`); `loaded_round` is the round returned. Pickled
        checkpoints of an older shoal (`round-<r>.pt`) are never read, and said so."""
        older = sorted(p.name for p in self.directory.glob("round-*.pt"))
        if older and self.warn is not None:
            self.warn(
                f"{len(older)} checkpoint(s) of an older shoal in {self.directory} ({older[-1]}) are not "
                "read (pickled files could run code): this peer starts fresh and re-syncs from the swarm"
            )
        for round_number in reversed(self.rounds()):
            path = self.directory / f"round-{round_number}{SUFFIX}"
            try:
                state = read(path, map_location)
            # safetensors and json raise several types for truncated or corrupt files
            except Exception as error:
                self._set_aside(round_number, f"{type(error).__name__}: {error}".splitlines()[0])
                continue
            if not isinstance(state, dict) or state.get("round") != round_number:
                held = state.get("round") if isinstance(state, dict) else type(state).__name__
                self._set_aside(round_number, f"it holds round {held}")
                continue
            self.loaded_round = round_number
            return state
        return None

    def _write(self, target: Path, state: dict) -> None:
        """The checkpoint to `target`, whole and durably (shoal.peer.files.write_atomically); a failure
        leaves `target` as it was."""
        tensors, tree = encode(state)
        metadata = {TREE_KEY: json.dumps(tree)}
        write_atomically(target, lambda file: file.write(save(tensors, metadata=metadata)), durable=True)

    def _set_aside(self, round_number: int, reason: str) -> None:
        """Renames a damaged checkpoint so that it is neither loaded nor kept, and says so."""
        path = self.directory / f"round-{round_number}{SUFFIX}"
        aside = path.with_name(path.name + DAMAGED_SUFFIX)
        try:
            path.replace(aside)
            what = f"moved aside to {aside.name}"
        except OSError as error:
            self._unreadable.add(round_number)
            what = f"left in place, could not be renamed: {error.strerror or error}"
        if self.warn is not None:
            self.warn(f"the checkpoint {path} is damaged ({reason}): {what}; trying the one before it")


def read(path: Path, map_location: str | torch.device = "cpu") -> dict:
    """A checkpoint file's dict (`encode`'s inverse); raises on a file that is not one."""
    with safe_open(str(path), framework="pt", device="cpu") as file:
        tree = json.loads((file.metadata() or {})[TREE_KEY])
        tensors = {key: file.get_tensor(key).to(map_location) for key in file.keys()}  # noqa: SIM118
    return decode(tree, tensors)


def encode(value: Any, path: str = "", tensors: dict | None = None) -> tuple[dict, Any]:
    """(tensors by path, the JSON tree of `value` with each tensor as {"tensor": its path}); dicts
    become {"dict": [[key, value], ...]} and tuples lists."""
    tensors = {} if tensors is None else tensors
    if isinstance(value, torch.Tensor):
        key = path or "tensor"
        tensors[key] = value.detach().to("cpu").contiguous().clone()  # no storage shared between two
        return tensors, {"tensor": key}
    if isinstance(value, dict):
        items = [[k, encode(v, f"{path}/{k}", tensors)[1]] for k, v in value.items()]
        return tensors, {"dict": items}
    if isinstance(value, list | tuple):
        return tensors, {"list": [encode(v, f"{path}/{i}", tensors)[1] for i, v in enumerate(value)]}
    if value is None or isinstance(value, bool | int | float | str):
        return tensors, {"value": value}
    raise TypeError(f"a checkpoint holds tensors and plain values, not {type(value).__name__} at {path}")


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """`encode`'s tree back into its value; ValueError on anything else."""
    if not isinstance(tree, dict) or len(tree) != 1:
        raise ValueError(f"not a checkpoint tree: {str(tree)[:80]}")
    ((kind, body),) = tree.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {key: decode(value, tensors) for key, value in body}
    if kind == "list":
        return [decode(value, tensors) for value in body]
    if kind == "value":
        return body
    raise ValueError(f"not a checkpoint tree: {kind!r}")
