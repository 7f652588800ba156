"""Shared test settings: hypothesis profile with no per-example deadline (CI machines are slow), and
no process left running after a test."""

import contextlib
import os
import shutil
import signal
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.integration import launcher

# The `shoal join` processes the tests start share CI's two cores with each other and with the other
# worker's tests: each computes at most 64 micro-batches a step, the load the tests were sized for
# (`shoal join`'s default, 4096, lets a fast device fill its round). Set before any peer starts, so
# that every child inherits it; a test that passes --max-micro-batches still sets its own.
os.environ.setdefault("SHOAL_MAX_MICRO_BATCHES", "64")

settings.register_profile("shoal", deadline=None, max_examples=60)
settings.load_profile("shoal")

# tests/hostile_messages.py is a plain helper module whose asserts are the checks of many tests:
# have pytest rewrite them (as it would in a test module) so their failures show the values compared.
pytest.register_assert_rewrite("tests.hostile_messages")


# ---------------------------------------------------------------------------------------------
# Leftover processes: whatever an integration test started and did not stop (a peer, its DHT process, a p2pd
# daemon, a coordinator) is killed after it, so that one failing test cannot slow down or disturb
# the next ones. Each kill is reported as a warning naming the process, so a leak stays visible.
# ---------------------------------------------------------------------------------------------


def _processes() -> dict[int, tuple[int, str, str]]:
    """Every process: pid -> (parent pid, state, name), from /proc (Linux)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        found[int(entry)] = (int(rest[1]), rest[0], name)
    return found


def _descendants(root: int) -> dict[int, str]:
    """The live (not zombie) processes below `root`: pid -> name."""
    processes = _processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    found, stack = {}, [root]
    while stack:
        for child in children.get(stack.pop(), []):
            stack.append(child)
            if processes[child][1] != "Z":
                found[child] = processes[child][2]
    return found


KEPT = ("torch_shm_manager", "resource_tracker", "forkserver", "semaphore_tracker")
"""Helpers that serve the test process itself for its whole life (torch's shared-memory manager,
multiprocessing's trackers), started by whichever test first needs them: never leftovers."""


def _serves_this_process(pid: int, name: str) -> bool:
    if pid == launcher.zygote_pid():  # it forks the integration tests' peers for the whole session
        return True
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(helper in name or helper in command for helper in KEPT)


@pytest.fixture(autouse=True)
def no_leftover_processes(request):
    """Integration tests only (the unit tests start no processes, and /proc is read twice a test)."""
    if "integration" not in request.node.path.parts or not Path("/proc/self/stat").exists():
        yield
        return
    launcher.ensure_started()
    before = set(_descendants(os.getpid()))
    yield
    leftovers: dict[int, str] = {}
    for _ in range(5):  # stopped first, so that none forks a child the kill would orphan
        found = {
            pid: name
            for pid, name in _descendants(os.getpid()).items()
            if pid not in before and not _serves_this_process(pid, name)
        }
        if found.keys() <= leftovers.keys():
            break
        for pid in found.keys() - leftovers.keys():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        leftovers |= found
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in leftovers:  # reap the direct children; the others are reaped by their parents (or init)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
    if leftovers:
        warnings.warn(f"killed processes the test left running: {sorted(leftovers.values())}", stacklevel=1)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder with a short path, removed after the test: a TMPDIR for processes that make Unix
    sockets in it (torch's shared-memory manager), whose paths must fit in 108 bytes, which a
    `tmp_path` under pytest-xdist (one more level, popen-gwN) does not leave room for."""
    folder = Path(tempfile.mkdtemp(prefix="shoal-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


INTEGRATION = Path(__file__).resolve().parent / "integration"


HEAVIEST = ("test_hostile.py", "test_nat.py", "test_swarm.py", "test_cli_swarm.py", "test_start_run.py")
"""The integration files that take longest (minutes each), collected first: `pytest -n 2 --dist
loadfile` hands files to its workers in collection order, and a heavy one left for last would keep
one worker busy long after the other is done."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/integration is a `swarm` test: `pytest -m "not swarm"` leaves them out.
    The heaviest files go first (a stable sort: the order within a file is kept)."""
    for item in items:
        if INTEGRATION in Path(item.fspath).parents:
            item.add_marker(pytest.mark.swarm)
    weight = {name: index for index, name in enumerate(HEAVIEST)}
    items.sort(key=lambda item: weight.get(Path(item.fspath).name, len(HEAVIEST)))
