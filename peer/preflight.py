"""What `shoal join` checks on this machine before it imports torch or starts anything: the ports it
will listen on (first: a port in use is the most common mistake, and reported at once), the checkpoint
folder and the folder of the address file. Each failure is a `SettingsError` naming the flag to fix
(the CLI exits 2 with it). The checks that need torch (device, model, data) follow in shoal.peer.node,
still before the DHT starts.

    python -c "from shoal.peer import preflight, spec; preflight.check(spec.PeerSpec())"
"""

import errno
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
