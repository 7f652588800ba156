"""The one fault seam (shoal.peer.job.faults): what `shoal join` reads from SHOAL_FAULTS, and what it
refuses, naming the variable."""

import pytest

from shoal.peer.config.settings import SettingsError
from shoal.peer.job.faults import NO_FAULTS, Faults, faults, from_environment
from shoal.peer.swarm.exchange import SwarmExchange


def test_no_variable_is_no_fault_and_the_shipped_registry_has_a_slow_peer():
    assert from_environment({}) is NO_FAULTS
    assert from_environment({"SHOAL_FAULTS": "  "}) is NO_FAULTS
    slow = from_environment({"SHOAL_FAULTS": "shoal.peer.job.faults:slow=1.5"})
    assert slow == Faults(compute_delay_s=1.5) and slow.exchange_type is SwarmExchange
    assert faults("") is NO_FAULTS


def test_the_tests_registry_builds_a_faulty_exchange():
    made = from_environment({"SHOAL_FAULTS": "tests.integration.faults:sign_flip@2 hang@5"})
    assert issubclass(made.exchange_type, SwarmExchange) and made.exchange_type is not SwarmExchange
    assert [(f.kind, f.round) for f in made.exchange_type.faults] == [("sign_flip", 2), ("hang", 5)]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("sign_flip@0", "expected MODULE:SPEC"),
        ("no.such.module:slow=1", "cannot import no.such.module"),
        ("json:slow=1", "json has no faults(spec) registry"),
        ("shoal.peer.job.faults:fast=1", "unknown fault 'fast=1'"),
        ("shoal.peer.job.faults:slow=99999", "compute_delay_s must be in"),
        ("tests.integration.faults:teleport@1", "a fault is KIND@ROUND"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(value, said):
    with pytest.raises(SettingsError, match="SHOAL_FAULTS") as refused:
        from_environment({"SHOAL_FAULTS": value})
    assert said in str(refused.value)
