"""What `shoal join` checks on this machine before it imports torch or starts anything: the ports it
will listen on (first: a port in use is the most common mistake, and reported at once), the checkpoint
folder (writable, and no other live peer's: `lock_folder`) and the folder of the address file. Each
failure is a `SettingsError` naming the flag to fix (the CLI exits 2 with it). The checks that need
torch (device, model, data) follow in shoal.peer.node, still before the DHT starts.

    python -c "from shoal.peer import preflight, spec; preflight.check(spec.PeerSpec())"
"""

import errno
import fcntl
import os
import socket
import tempfile
from pathlib import Path

from shoal.peer.settings import PeerSpec, SettingsError


def check(settings: PeerSpec) -> None:
    """Raises SettingsError for the first setting this machine cannot use."""
    check_port(settings.network.host, settings.network.port, "--port")
    if settings.logging.metrics_port:
        check_port(settings.network.host, settings.logging.metrics_port, "--metrics-port")
    if settings.checkpoint.dir:
        check_writable_folder(Path(settings.checkpoint.dir), "--checkpoint-dir")
        lock_folder(Path(settings.checkpoint.dir), "--checkpoint-dir")
    if settings.network.address_file:
        check_writable_folder(Path(settings.network.address_file).parent, "--address-file")


def check_port(host: str, port: int, flag: str) -> None:
    """That `host:port` (TCP) is free to listen on; port 0 (any free one) always is."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise SettingsError(
                    f"{flag} {port}: the port is in use on {host} (another shoal peer?): choose another "
                    f"{flag}, or {flag} 0 for any free one"
                ) from None
            raise SettingsError(f"{flag} {port}: cannot listen on {host}:{port}: {error.strerror}") from None


def check_writable_folder(folder: Path, flag: str) -> None:
    """That `folder` exists or can be created, and that a file can be written in it (a real write: as
    root, permission bits say nothing, and a read-only mount shows only on writing)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".shoal-write-check-"):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise SettingsError(
            f"{flag}: cannot write in {folder} ({reason}): choose a folder this user can write to"
        ) from None


LOCK_NAME = "shoal.lock"
_held: dict[Path, int] = {}  # the lock files this process holds, open for as long as it runs


def lock_folder(folder: Path, flag: str) -> None:
    """Claims `folder` for this process: two peers writing checkpoints to one folder would overwrite
    each other's (and one would resume from the other's state). The claim is an exclusive POSIX lock
    on `folder/shoal.lock`, which holds the claimant's pid for the message; the kernel drops it when
    the process ends however it ends, so the file a killed peer left claims nothing, and it is not
    inherited by the peer's forked DHT process, which may outlive a killed peer by a moment.
    SettingsError naming the pid that holds it. Claiming a folder this process already holds does nothing."""
    key = folder.resolve()
    if key in _held:
        return
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise SettingsError(f"{flag}: cannot create {path} ({error.strerror or error})") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise SettingsError(f"{flag}: cannot lock {path} ({error.strerror or error})") from None
        raise SettingsError(
            f"{flag} {folder}: in use by another running peer (pid {holder}): each peer needs a "
            f"{flag} of its own, or the peers' checkpoints overwrite each other"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = fd


def unlock_folder(folder: Path) -> None:
    """Gives up this process's claim on `folder` (tests; a process that ends drops it anyway)."""
    fd = _held.pop(folder.resolve(), None)
    if fd is not None:
        os.close(fd)
