"""The swarm's round clock, kept in the checkpoint folder (`CLOCK_FILE`): a peer restarted without
--initial-peers (a swarm's first peer, its container restarted) continues it, so that the others still
take it for one of theirs."""

import json
import math
import time
from pathlib import Path

from shoal.peer.config.spec import PeerSpec
from shoal.peer.files import replace_text
from shoal.peer.job.progress import Progress
from shoal.peer.swarm.records import RoundSchedule


class ClockError(RuntimeError):
    """The clock cannot be kept where the spec says; the message says what to do."""


CLOCK_FILE = "clock.json"


def saved_clock(settings: PeerSpec, progress: Progress) -> RoundSchedule | None:
    """The clock saved in the checkpoint folder, if it is this run's, with these rounds, and no
    --start-time says otherwise."""
    if not settings.checkpoint.dir or settings.run.start_time:
        return None
    path = Path(settings.checkpoint.dir) / CLOCK_FILE
    try:
        saved = json.loads(path.read_text())
        start_time, round_seconds = float(saved["start_time"]), float(saved["round_seconds"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        progress.message(f"ignoring {path} ({error}): starting a new round clock")
        return None
    asked = settings.run.round_seconds  # None: the rounds this peer would choose, the saved ones
    if saved.get("run") != settings.run.name or asked not in (None, round_seconds):
        return None  # another swarm, or other rounds on purpose: a new clock
    if not (math.isfinite(start_time) and 0 < start_time <= time.time() + 86400):
        progress.message(f"ignoring {path}: its start time {start_time} is not a time")
        return None
    progress.message(f"continuing the round clock of {path} (rounds of {round_seconds:g} s)")
    return RoundSchedule(start_time=start_time, round_seconds=round_seconds)


def save_clock(settings: PeerSpec, schedule: RoundSchedule) -> None:
    """Keeps the round clock in the checkpoint folder; ClockError if it cannot be written there (it was
    writable when the peer started: it cannot be now, before any round is lost)."""
    if settings.checkpoint.dir:
        clock = {
            "run": settings.run.name,
            "start_time": schedule.start_time,
            "round_seconds": schedule.round_seconds,
        }
        path = Path(settings.checkpoint.dir) / CLOCK_FILE
        try:
            replace_text(path, json.dumps(clock), durable=True)
        except OSError as error:
            raise ClockError(
                f"cannot write the round clock {path}: {error.strerror or error}: make the folder writable, "
                "or choose another --checkpoint-dir"
            ) from None
