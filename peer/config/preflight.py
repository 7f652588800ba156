"""What `shoal join` checks on this machine before it imports torch or starts anything: the ports it
will listen on (first: a port in use is the most common mistake, and reported at once), the checkpoint
folder (writable, and no other live peer's: `lock_folder`) and the folder of the address file. Each
failure is a `SettingsError` naming the flag to fix (the CLI exits 2 with it). The checks that need
torch (device, model, data) follow in shoal.peer.job.node, still before the DHT starts.

    python -c "from shoal.peer.config import preflight, spec; preflight.check(spec.PeerSpec())"
"""

import errno
import fcntl
import glob
import json
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any

from shoal.peer.config.settings import PeerSpec, SettingsError


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
    check_inputs(settings)


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


# shoal.peer.models.loading' names (which imports torch), kept equal by tests/unit/test_peer_service.py
EMBEDDED = ("tiny", "small", "base")
EMBEDDED_MAX_SEQ_LEN = 1 << 16
FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# where a Hugging Face config.json says how many positions a model has, by architecture
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def check_inputs(settings: PeerSpec) -> None:
    """The files the settings name, read as files only (no torch, no model built): --model's directory
    and its config.json, --seq-len against the positions it has, --tokenizer, the tokenizer's ids
    against the model's vocabulary, and --data. A mistake here is told in well under a second, not
    after the seconds a model takes to load; what only loading can tell is checked then."""
    model, seq_len = settings.model.name, settings.model.seq_len
    config = _model_config(model)
    if seq_len is not None:
        most = EMBEDDED_MAX_SEQ_LEN if model in EMBEDDED else _positions(config)
        if most is not None and not 1 <= seq_len <= most:
            raise SettingsError(f"--seq-len {seq_len}: --model {model} takes 1 to {most} tokens a sample")
    tokenizer, named_by = _tokenizer_file(settings.data.tokenizer, model)
    vocab = config.get("vocab_size") if config is not None else None
    if tokenizer is not None and isinstance(vocab, int) and vocab > 0:
        top = _top_token_id(tokenizer, named_by)
        if top is not None and top >= vocab:
            raise SettingsError(
                f"{named_by} holds token ids up to {top}, but --model {model} reads only {vocab} "
                f"(vocab_size in {Path(model) / 'config.json'}): give the model's own tokenizer "
                "(--tokenizer), or a model of this tokenizer's vocabulary"
            )
    _check_data(settings.data.source)


def _model_config(model: str) -> dict[str, Any] | None:
    """A Hugging Face directory's config.json (None for the embedded presets and factories)."""
    if model in EMBEDDED or FACTORY.match(model):
        return None
    folder = Path(model)
    if not folder.is_dir():
        raise SettingsError(
            f"--model {model}: expected one of {', '.join(EMBEDDED)}, a module:factory, or a Hugging Face "
            "model directory (there is no such directory)"
        )
    path = folder / "config.json"
    if not path.is_file():
        raise SettingsError(f"--model {model}: a directory without config.json is not a Hugging Face model")
    return _json_object(path, f"--model {model}")


def _json_object(path: Path, named_by: str) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SettingsError(f"{named_by}: cannot read {path}: {error}") from None
    if not isinstance(found, dict):
        raise SettingsError(f"{named_by}: {path} holds no JSON object")
    return found


def _positions(config: dict[str, Any] | None) -> int | None:
    if config is None:
        return None
    for key in POSITIONS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _tokenizer_file(spec: str | None, model: str) -> tuple[Path | None, str]:
    """The tokenizer.json the peer will read (shoal.peer.data.tokenizer.load_tokenizer's choice), and
    how to name it in a message."""
    if spec == "bytes":
        return None, ""
    if spec is not None:
        path = Path(spec)
        if not path.exists():
            raise SettingsError(f"--tokenizer {spec}: no such file or directory")
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise SettingsError(
                    f"--tokenizer {spec}: the folder holds no tokenizer.json (save a fast tokenizer there: "
                    "tokenizer.save_pretrained)"
                )
            path = path / "tokenizer.json"
        return path, f"--tokenizer {spec}"
    own = Path(model) / "tokenizer.json"
    if model not in EMBEDDED and not FACTORY.match(model) and own.is_file():
        return own, f"--model {model}'s tokenizer.json"
    return None, ""


def _top_token_id(path: Path, named_by: str) -> int | None:
    """The largest id a tokenizer.json can produce: its model's vocabulary and its added tokens."""
    tokenizer = _json_object(path, named_by)
    ids = []
    vocab = (tokenizer.get("model") or {}).get("vocab") if isinstance(tokenizer.get("model"), dict) else None
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # Unigram: (piece, score) in id order
        ids.append(len(vocab) - 1)
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            ids.append(added["id"])
    return max(ids) if ids else None


def _check_data(source: str) -> None:
    """That --data names something: the standard library, files a pattern matches, or a path."""
    if source == "stdlib":
        return
    if any(mark in source for mark in "*?["):
        if not any(Path(name).is_file() for name in glob.iglob(source, recursive=True)):
            raise SettingsError(f"--data {source}: the pattern matches no file")
    elif not Path(source).exists():
        raise SettingsError(f"--data {source}: no such file or directory")
