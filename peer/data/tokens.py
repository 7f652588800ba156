"""Token ids read window by window, from memory or from files that are never loaded whole.

A `Tokens` is a sequence of token arrays: numpy arrays in memory (the standard-library corpus, bytes)
or `FileArray`s, a run of fixed-width little-endian integers at an offset of a file (a shard of
`shoal data prepare`, an `.npy` file, a nanoGPT or llm.c `.bin`). Window i of `size` tokens lies in one
array: the arrays' windows are numbered one array after the other, and an array's tail shorter than a
window is not read. A file's windows are read with one positioned read each (`os.pread`), not mapped:
a mapped corpus would count in the peer's resident memory as the run touches it, page by page, up to
the corpus's size.
"""

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CHUNK_TOKENS = 1 << 22
"""Tokens per read when a whole array is scanned (`max_id`, `digest`)."""


@dataclass(frozen=True, slots=True)
class FileArray:
    """`length` integers of `dtype` (little-endian) at byte `offset` of the file at `path`."""

    path: Path
    offset: int
    dtype: np.dtype
    length: int

    @property
    def size(self) -> int:
        return self.length

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the array."""
        return self.read_many([start], count)[0]

    def read_many(self, starts: Sequence[int], count: int) -> list[np.ndarray]:
        """Tokens [start, start + count) for each of `starts`, the file opened once."""
        width, runs = self.dtype.itemsize, []
        with open(self.path, "rb") as file:
            for start in starts:
                data = os.pread(file.fileno(), count * width, self.offset + start * width)
                if len(data) != count * width:
                    raise ValueError(f"{self.path}: shorter than its header or manifest says (truncated?)")
                runs.append(np.frombuffer(data, dtype=self.dtype))
        return runs

    def chunks(self) -> Iterator[np.ndarray]:
        for start in range(0, self.length, CHUNK_TOKENS):
            yield self.read(start, min(CHUNK_TOKENS, self.length - start))


Array = np.ndarray | FileArray


class Tokens:
    """Token arrays read window by window (see the module docstring)."""

    def __init__(self, arrays: Sequence[Array]):
        self.arrays = [array for array in arrays if array.size]

    @staticmethod
    def of(ids: "Tokens | torch.Tensor | np.ndarray") -> "Tokens":
        """Token ids in memory (a tensor or an array), as one array."""
        if isinstance(ids, Tokens):
            return ids
        return Tokens([ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)])

    def __len__(self) -> int:
        return sum(array.size for array in self.arrays)

    def windows(self, size: int) -> int:
        """How many windows of `size` tokens the arrays hold."""
        return sum(array.size // size for array in self.arrays)

    def rows(self, indices: torch.Tensor | np.ndarray, size: int) -> torch.Tensor:
        """Windows `indices` of `size` tokens, as an int64 tensor (len(indices), size)."""
        wanted = np.asarray(indices, dtype=np.int64).reshape(-1)
        counts = np.array([array.size // size for array in self.arrays], dtype=np.int64)
        starts = np.cumsum(counts) - counts
        if wanted.size and not 0 <= wanted.min() <= wanted.max() < counts.sum():
            raise IndexError(f"a window outside [0, {int(counts.sum())})")
        out = np.empty((wanted.size, size), dtype=np.int64)
        home = np.searchsorted(starts, wanted, side="right") - 1
        for index in np.unique(home):
            array, mask = self.arrays[index], home == index
            local = wanted[mask] - starts[index]
            if isinstance(array, FileArray):
                out[mask] = np.stack(array.read_many([int(window) * size for window in local], size))
            else:
                out[mask] = array[: counts[index] * size].reshape(-1, size)[local]
        return torch.from_numpy(out)

    def split(self, tail_share: float) -> tuple["Tokens", "Tokens"]:
        """(the tokens but the last `tail_share` of the last array, that tail)."""
        *head, last = self.arrays
        cut = int(last.size * (1 - tail_share))
        return Tokens([*head, _part(last, 0, cut)]), Tokens([_part(last, cut, last.size)])

    def max_id(self) -> int:
        """The largest token id; -1 when empty (`scan`)."""
        return self.scan()[0]

    def digest(self) -> str:
        """SHA-256 of the ids as little-endian uint32, the same for any storage width (`scan`)."""
        return self.scan()[1]

    def scan(self) -> tuple[int, str]:
        """(the largest id, the digest), reading every array once, a chunk at a time; ValueError for
        a negative id."""
        largest, hasher = -1, hashlib.sha256()
        for chunk in self._chunks():
            largest = max(largest, int(chunk.max()))
            if chunk.min() < 0:
                raise ValueError("negative token ids")
            hasher.update(chunk.astype("<u4").tobytes())
        return largest, hasher.hexdigest()

    def _chunks(self) -> Iterator[np.ndarray]:
        for array in self.arrays:
            if isinstance(array, FileArray):
                yield from array.chunks()
            else:
                yield from (array[i : i + CHUNK_TOKENS] for i in range(0, array.size, CHUNK_TOKENS))


def _part(array: Array, start: int, stop: int) -> Array:
    if isinstance(array, FileArray):
        width = array.dtype.itemsize
        return FileArray(array.path, array.offset + start * width, array.dtype, stop - start)
    return array[start:stop]
