"""The one seam through which a peer is made to fail on purpose: a `Faults` value handed to
`assembly.build_peer`. An honest peer gets `NO_FAULTS`.

`shoal join` reads one from the environment when `SHOAL_FAULTS` is set (`from_environment`), as
`MODULE:SPEC`: MODULE's `faults(SPEC)` builds it. MODULE is a registry of faults; the tests' is
tests/integration/faults.py (a peer that exits, hangs, vanishes, poisons or malforms its payloads,
lies in its claims or its butterfly means: `SHOAL_FAULTS=tests.integration.faults:sign_flip@0`).
This module is the one registry that ships, with one fault: `slow=S`, a peer that sleeps S seconds
before each round's computation (`shoal demo --slow-peer`: a straggler the coordinator leaves out).
"""

import importlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from shoal.peer.config.settings import SettingsError
from shoal.peer.swarm.exchange import SwarmExchange

ENVIRONMENT = "SHOAL_FAULTS"
MAX_DELAY_S = 3600.0


@dataclass(frozen=True, slots=True)
class Faults:
    """What a peer does wrong on purpose."""

    exchange_type: type[SwarmExchange] = SwarmExchange
    """The exchange it is built with: a subclass that carries out the faults (its payloads, its
    claims, its server's answers, its process's end) from the rounds it plans."""
    compute_delay_s: float = 0.0
    """Seconds it sleeps before each round's first micro-batch: a slow peer."""

    def __post_init__(self) -> None:
        if not issubclass(self.exchange_type, SwarmExchange):
            raise TypeError(f"exchange_type must be a SwarmExchange, not {self.exchange_type!r}")
        if not 0.0 <= self.compute_delay_s <= MAX_DELAY_S:
            raise ValueError(f"compute_delay_s must be in [0, {MAX_DELAY_S:g}], got {self.compute_delay_s}")


NO_FAULTS = Faults()


def faults(spec: str) -> Faults:
    """This registry's faults: `slow=S` (S seconds before each round's computation), or nothing."""
    spec = spec.strip()
    if not spec:
        return NO_FAULTS
    found = re.fullmatch(r"slow=(\d+(?:\.\d+)?)", spec)
    if found is None:
        raise ValueError(f"unknown fault {spec!r}: this registry has slow=SECONDS")
    return Faults(compute_delay_s=float(found.group(1)))


def from_environment(environ: Mapping[str, str] = os.environ) -> Faults:
    """The faults `SHOAL_FAULTS=MODULE:SPEC` names (unset or empty: none); SettingsError naming the
    variable if the module cannot be imported, has no registry, or refuses SPEC."""
    value = environ.get(ENVIRONMENT, "").strip()
    if not value:
        return NO_FAULTS
    module_name, colon, spec = value.partition(":")
    if not colon or not re.fullmatch(r"[A-Za-z_][\w.]*", module_name):
        raise SettingsError(f"{ENVIRONMENT}={value!r}: expected MODULE:SPEC, as in {__name__}:slow=2")
    try:
        registry = importlib.import_module(module_name)
    except ImportError as error:
        raise SettingsError(f"{ENVIRONMENT}: cannot import {module_name} ({error})") from None
    build = getattr(registry, "faults", None)
    if not callable(build):
        raise SettingsError(f"{ENVIRONMENT}: {module_name} has no faults(spec) registry")
    try:
        made = build(spec)
    except ValueError as error:
        raise SettingsError(f"{ENVIRONMENT}: {error}") from None
    if not isinstance(made, Faults):
        raise SettingsError(f"{ENVIRONMENT}: {module_name}.faults returned {type(made).__name__}, not Faults")
    return made
