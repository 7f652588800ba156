"""Helper processes that die with the process that started them, even when it is killed with kill -9.

A peer forks hivemind's DHT process, which starts the p2pd daemon. A parent that exits normally shuts
them down, but a parent killed by SIGKILL (or the OOM killer) runs no cleanup: both would live on,
orphaned, holding the peer's ports. `die_with_parent()`, called first thing in the forked child, ties the
child and everything it starts afterwards to the parent:

- the child leads a new session, so its children (p2pd) share its process group and the terminal's
  Ctrl-C reaches only the peer, which then leaves at its round's end with its DHT still working;
- the child ignores SIGTERM and SIGINT: a signal sent to every process of the peer (systemd's
  control group, `pkill -f "shoal join"`) must not take the DHT away from a peer that is still
  finishing its round and checkpointing. The peer ends it (`TetheredDHT.shutdown`);
- a daemon thread polls the parent's pid; once the parent is gone (the child was re-parented), it
  sends SIGTERM to the whole group, which p2pd closes its sockets on, and the child exits.

A thread that polls, rather than Linux's PR_SET_PDEATHSIG, because the signal would reach only the
child: p2pd is started by hivemind through asyncio without a hook to set the signal in it, and a child
killed outright could not pass it on. Polling works the same on Linux and macOS.
"""

import os
import signal
import threading
import time
from datetime import timedelta

PARENT_POLL = timedelta(seconds=0.5)
"""How often the child checks that its parent lives: the children outlive it by at most this."""


def die_with_parent(parent_pid: int, poll: timedelta = PARENT_POLL) -> None:
    """Ties the calling process and its future children to `parent_pid`, the process that started it.

    Call it in the child, before it starts children of its own. If the parent is already gone, the
    group is ended at once."""
    os.setsid()
    # a handler inherited through fork would run the parent's stop here; the parent ends this process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_end_group_when_orphaned, args=(parent_pid, poll), name="die-with-parent", daemon=True
    ).start()


def _end_group_when_orphaned(parent_pid: int, poll: timedelta) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll.total_seconds())
    os.killpg(os.getpgid(0), signal.SIGTERM)  # p2pd; this process ignores it
    os._exit(0)
