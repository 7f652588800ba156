"""Progress of a peer or of a local swarm, for humans (a live table) or machines (JSON lines).

Rows are dicts with the keys of `COLUMNS`. `human` mode redraws a table of the last rounds on a
terminal (rich) and prints one plain line per round elsewhere (pipes, CI logs); `json` mode writes one
JSON object per line: `{"event": "round", ...}`, and whatever `event()` is given.
"""

import json
import sys
import time
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

COLUMNS = {
    "round": ("round", "{:d}"),
    "loss": ("loss", "{:.4f}"),
    "tokens_per_s": ("tokens/s", "{:,.0f}"),
    "participants": ("peers", "{:d}"),
    "together": ("together", "{}"),
    "micro_batches": ("micro-batches", "{}"),
    "bytes_up": ("up", "{}"),
    "bytes_down": ("down", "{}"),
    "round_s": ("round s", "{:.2f}"),
    "epoch": ("epoch", "{:.2f}"),
}
SHOWN_ROUNDS = 15


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("bytes_up", "bytes_down"):
        return human_bytes(value)
    return COLUMNS[key][1].format(value)


class Progress:
    """Round rows to a stream, as a live table (`human`) or JSON lines (`json`)."""

    def __init__(self, log_format: str = "human", stream: IO[str] | None = None, title: str = "shoal"):
        if log_format not in ("human", "json"):
            raise ValueError(f"log format must be human or json, got {log_format!r}")
        self.log_format, self.title = log_format, title
        self.stream = stream or sys.stdout
        self.rows: list[dict[str, Any]] = []
        self._console = Console(file=self.stream, highlight=False, soft_wrap=True)
        self._live: Live | None = None
        if log_format == "human" and self._console.is_terminal:
            self._live = Live(self._table(), console=self._console, auto_refresh=False)
            self._live.start()

    def message(self, text: str) -> None:
        """A line for humans (in json mode: `{"event": "message", "text": ...}`)."""
        if self.log_format == "json":
            self.event("message", text=text)
        else:
            self._console.print(text, markup=False)

    def event(self, name: str, **fields: Any) -> None:
        """A JSON line in json mode; nothing for humans."""
        if self.log_format == "json":
            # when it happened, on the Unix clock (seconds, to the millisecond), as log collectors read it
            self.stream.write(json.dumps({"event": name, "time": round(time.time(), 3), **fields}) + "\n")
            self.stream.flush()

    def round(self, row: dict[str, Any], **extra: Any) -> None:
        self.rows.append(row)
        if self.log_format == "json":
            self.event("round", **row, **extra)
        elif self._live is not None:
            self._live.update(self._table(), refresh=True)
        else:
            self._console.print(
                "  ".join(f"{COLUMNS[k][0]} {_cell(k, row.get(k))}" for k in COLUMNS), markup=False
            )

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _table(self) -> Table:
        table = Table(title=self.title, title_justify="left")
        for _, (header, _) in COLUMNS.items():
            table.add_column(header, justify="right")
        for row in self.rows[-SHOWN_ROUNDS:]:
            table.add_row(*(_cell(k, row.get(k)) for k in COLUMNS))
        return table
