"""Settings of `shoal join`: from flags, then `SHOAL_*` environment variables, then a TOML file, then
defaults; the first that names a setting wins. They make one `PeerSpec` (shoal.peer.config.spec), which
checks every value; a bad one raises `SettingsError` naming the setting and where it came from (the
CLI exits 2 with it).

    SHOAL_MODEL=small SHOAL_INITIAL_PEERS="/ip4/.../p2p/A /ip4/.../p2p/B" shoal join --config run.toml

Flags and variables are flat (`--checkpoint-every`, `SHOAL_CHECKPOINT_EVERY`); the TOML file has one
section per component, with the spec's field names:

    [model]
    name = "small"
    [checkpoint]
    every = 5

An unknown section or key is an error, so that a typo does not silently train with a default; a key
of the flat form of earlier versions (`model = "small"` at the top) is refused naming its section.
"""

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shoal.peer.config.spec import ALGORITHMS, FLAGS, PARSERS, SECTIONS, PeerSpec

__all__ = ["ALGORITHMS", "MAX_CONFIG_BYTES", "PARSERS", "PeerSpec", "SettingsError", "resolve"]

MAX_CONFIG_BYTES = 1 << 20


class SettingsError(ValueError):
    """A setting has a bad value; the message names it."""


def resolve(flags: Mapping[str, Any], environ: Mapping[str, str], config_path: str | None = None) -> PeerSpec:
    """Settings from `flags` (by flag name; None: not given), then `SHOAL_<NAME>` in `environ`, then
    the TOML file at `config_path` (or `SHOAL_CONFIG`), then defaults."""
    config_path = config_path or environ.get("SHOAL_CONFIG") or None
    from_file = _read_toml(config_path) if config_path else {}
    values = {}
    for name, parse in PARSERS.items():
        section, key = FLAGS[name]
        sources = (
            ("--" + name.replace("_", "-"), flags.get(name)),
            ("SHOAL_" + name.upper(), environ.get("SHOAL_" + name.upper())),
            (f"{key} in [{section}] of {config_path}", from_file.get(section, {}).get(key)),
        )
        for where, raw in sources:
            if raw is None:
                continue
            try:
                values[name] = parse(raw)
            except ValueError as error:
                raise SettingsError(f"{where}: {error}") from None
            break
    try:
        return PeerSpec.of(**values)
    except ValueError as error:  # settings that each parse but do not fit together, named
        raise SettingsError(str(error)) from None


def _read_toml(path: str) -> dict[str, dict[str, Any]]:
    try:
        with Path(path).open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise SettingsError(f"--config {path}: {error.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise SettingsError(f"--config {path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise SettingsError(f"--config {path}: not valid TOML ({error})") from None
    for name, value in table.items():
        if name in FLAGS and not isinstance(value, dict):
            section, key = FLAGS[name]
            raise SettingsError(f"--config {path}: {name!r} is now {key!r} in section [{section}]")
        if name not in SECTIONS or not isinstance(value, dict):
            raise SettingsError(
                f"--config {path}: unknown section {name!r} (sections: {', '.join(SECTIONS)})"
            )
        known = {key for section, key in FLAGS.values() if section == name}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SettingsError(
                f"--config {path}: unknown setting {', '.join(map(repr, unknown))} in [{name}]"
            )
    return table
