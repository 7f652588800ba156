"""Process peers without the imports: a zygote that has imported torch, hivemind and shoal once forks
each `python -m MODULE ARGS...` the integration tests start, so that a peer is training a second
after it is asked for instead of after the seconds its imports take on two busy cores.

    process = launch(["-m", "shoal.peer.cli", "join", ...], env=..., stdout=file)   # Popen-like
    process.wait(timeout=60)

The zygote (`python -m tests.integration.launcher ZYGOTE_SOCKET`) is started on first use and lives
as long as the test session. It is single-threaded when it forks (tests/unit/test_layers.py checks
that importing shoal starts no thread), and each child starts a new session (so a kill of its process
group ends its DHT process and p2pd too), takes the stdio the caller passed, the caller's working
folder and environment, and runs the module as `python -m` would. The zygote reaps it and tells the
caller its exit status, as Popen's `returncode` spells it (-N: killed by signal N).

A variable read when a module is imported (OMP_NUM_THREADS by torch) takes the zygote's value:
1, as every test peer runs. Commands that are not `python -m` (hivemind-dht) use a plain Popen.
"""

import array
import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# torch._dynamo: each peer's fit propagates shapes in torch's FakeTensorMode, whose first use imports it
# (2.2 s of every peer's start on a quiet machine; it starts no thread)
PRELOADED = (
    "torch",
    "hivemind",
    "torch._dynamo",
    "shoal.peer.cli",
    "shoal.peer.job.node",
    "shoal.peer.job.runtime",
)
MAX_REQUEST_BYTES = 1 << 20
FIELD = 12  # a pid, then an exit status, each as this many ASCII bytes


class Launched:
    """A process the zygote forked, as much of `subprocess.Popen` as the tests use."""

    def __init__(self, connection: socket.socket, pid: int, stdout=None, stderr=None):
        self._connection, self.pid = connection, pid
        self.stdout, self.stderr, self.stdin = stdout, stderr, None
        self.returncode: int | None = None
        self.args = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read_status(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def _read_status(self, timeout: float | None) -> None:
        """The exit status, if the zygote tells it within `timeout` (0: now, None: waits)."""
        ready, _, _ = select.select([self._connection], [], [], timeout)
        if not ready:
            return
        data = self._connection.recv(FIELD, socket.MSG_WAITALL)
        self.returncode = int(data.decode()) if len(data) == FIELD else -signal.SIGKILL  # the zygote died
        self._connection.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Its output and errors, both pipes read at once (a child that fills one while the other is
        read would block on it), then its exit status, all within `timeout`."""
        read: dict[str, str] = {}
        pipes = {name: pipe for name, pipe in (("out", self.stdout), ("err", self.stderr)) if pipe}
        readers = [
            threading.Thread(
                target=lambda name=name, pipe=pipe: read.update({name: pipe.read()}), daemon=True
            )
            for name, pipe in pipes.items()
        ]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return read.get("out"), read.get("err")


class _Zygote:
    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="shoal-zygote-")
        self.path = os.path.join(self.folder, "socket")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.launcher", self.path],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the zygote did not start")
            time.sleep(0.05)
        atexit.register(self.close)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.folder)


_zygote: _Zygote | None = None
_lock = threading.Lock()


def ensure_started() -> "_Zygote":
    """The session's zygote, started (and its imports done) if it was not: tests/conftest.py starts it
    before the first integration test, so that no test's clock pays for it."""
    global _zygote
    with _lock:
        if _zygote is None:
            _zygote = _Zygote()
        return _zygote


def zygote_pid() -> int | None:
    """The zygote's pid, once started (tests/conftest.py leaves it running between tests)."""
    return None if _zygote is None else _zygote.process.pid


def launch(
    arguments: list[str], *, env: dict[str, str], cwd: Path = ROOT, stdin=None, stdout=None, stderr=None
):
    """`python ARGUMENTS...` (`["-m", MODULE, ...]`) forked from the zygote, in its own session; stdio
    as Popen takes them: None (inherit), subprocess.DEVNULL, subprocess.PIPE (text), a file or a
    descriptor."""
    if arguments[0] != "-m":
        raise ValueError("the zygote runs modules: ['-m', MODULE, ...]")
    zygote = ensure_started()
    descriptors, ours, pipes = [], [], {}
    for name, given, default in (("stdin", stdin, 0), ("stdout", stdout, 1), ("stderr", stderr, 2)):
        if given is None:
            descriptors.append(default)
        elif given == subprocess.DEVNULL:
            null = os.open(os.devnull, os.O_RDWR)
            descriptors.append(null)
            ours.append(null)
        elif given == subprocess.STDOUT and name == "stderr":
            descriptors.append(descriptors[1])
        elif given == subprocess.PIPE:
            read, write = os.pipe()
            pipes[name] = os.fdopen(read if name != "stdin" else write, "r" if name != "stdin" else "w")
            descriptors.append(write if name != "stdin" else read)
            ours.append(write if name != "stdin" else read)
        elif isinstance(given, int) and given < 0:
            raise ValueError(f"{name}={given} is not a descriptor the zygote can take")
        else:
            descriptors.append(given if isinstance(given, int) else given.fileno())
    request = json.dumps({"arguments": arguments[1:], "env": env, "cwd": str(cwd)}).encode()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(zygote.path)
    connection.sendmsg(
        [len(request).to_bytes(4, "little"), request],
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", descriptors))],
    )
    for descriptor in ours:
        os.close(descriptor)
    pid = int(connection.recv(FIELD, socket.MSG_WAITALL).decode())
    process = Launched(connection, pid, pipes.get("stdout"), pipes.get("stderr"))
    process.stdin = pipes.get("stdin")
    return process


# --- the zygote itself ----------------------------------------------------------------------------


def _child(request: dict, descriptors: list[int]) -> None:
    """In the forked child: becomes the module's process, and never returns."""
    code = 1
    try:
        os.setsid()
        for target, descriptor in enumerate(descriptors):
            os.dup2(descriptor, target)
        for descriptor in descriptors:
            if descriptor > 2:
                os.close(descriptor)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own, for its life)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        module, *arguments = request["arguments"]
        sys.argv = [module, *arguments]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, int | None):
            print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve(connection: socket.socket, waiting: dict[int, socket.socket]) -> None:
    """One request: forks the child and tells its pid; `waiting` keeps the connection for its status."""
    descriptors = []
    message, ancillary, _, _ = connection.recvmsg(4, socket.CMSG_LEN(3 * 4))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            descriptors = list(array.array("i", data[: len(data) - len(data) % 4]))
    size = int.from_bytes(message, "little")
    body = b""
    while 0 < size <= MAX_REQUEST_BYTES and len(body) < size:
        chunk = connection.recv(size - len(body))
        if not chunk:
            break
        body += chunk
    if len(descriptors) != 3 or not body or len(body) != size:
        connection.close()
        return
    pid = os.fork()
    if pid == 0:
        connection.close()
        _child(json.loads(body), descriptors)
    for descriptor in descriptors:
        os.close(descriptor)
    connection.sendall(f"{pid:>{FIELD}}".encode())
    waiting[pid] = connection


def _reap(waiting: dict[int, socket.socket]) -> None:
    """Tells the callers of the children that ended their exit status."""
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = waiting.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.sendall(f"{os.waitstatus_to_exitcode(status):>{FIELD}}".encode())
            connection.close()


def main(path: str) -> None:
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # ready: the caller waits for the path
    waiting: dict[int, socket.socket] = {}
    while True:  # one thread: a fork never copies another thread's lock
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            connection, _ = listener.accept()
            _serve(connection, waiting)
        _reap(waiting)


if __name__ == "__main__":
    main(sys.argv[1])
