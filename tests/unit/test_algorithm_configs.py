"""The algorithms as typed configs (shoal.peer.algorithms.configs): each `--algorithm` string parses into
one, bad values are refused naming the field, and a run's configuration hash is the one it was when the
algorithm was a string."""

import dataclasses

import pytest

from shoal.peer.algorithms.configs import (
    DEFAULTS,
    OUTER_MOMENTUM,
    SPARSE_ERROR_DECAY,
    SPARSE_OUTER,
    DeMoConfig,
    DiLoCoConfig,
    run_config,
)
from shoal.peer.config.settings import ALGORITHMS, PeerSpec, SettingsError, resolve
from shoal.peer.swarm.membership import run_hash


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("demo", DeMoConfig()),
        ("demo-overlap", DeMoConfig(overlapped=True)),
        ("diloco", DiLoCoConfig(mode="eager")),  # the alias
        ("diloco-standard", DiLoCoConfig(mode="standard")),
        ("diloco-delayed", DiLoCoConfig(mode="delayed")),
        ("diloco-eager", DiLoCoConfig(mode="eager")),
    ],
)
def test_each_algorithm_flag_parses_into_its_config(flag, expected):
    config = resolve({"algorithm": flag}, {}).algorithm_config()
    assert type(config) is type(expected) and config == expected
    assert config.name == ALGORITHMS[flag]  # the string runs, checkpoints and logs keep using


def test_every_flag_names_one_config_and_every_config_a_flag():
    assert set(ALGORITHMS) == {*DEFAULTS, "diloco"}
    assert set(ALGORITHMS.values()) == set(DEFAULTS)
    assert all(config.name == name for name, config in DEFAULTS.items())


def test_overlapped_algorithms_are_the_late_ones():
    """The coordinator runs with --overlap for exactly these (shoal demo, shoal bench wan)."""
    assert {name for name, config in DEFAULTS.items() if config.overlapped} == {
        "demo-overlap",
        "diloco-delayed",
        "diloco-eager",
    }


def test_the_settings_fill_in_the_hyperparameters_and_lr_0_is_the_algorithms_default():
    flags = {"topk": "8", "inner_steps": "20", "outer_lr": "0.7", "averaging": "butterfly"}
    demo = resolve({"algorithm": "demo", **flags, "averaging": None}, {}).algorithm_config()
    assert demo == DeMoConfig(lr=2e-3, topk=8)
    diloco = resolve(
        {"algorithm": "diloco-standard", "lr": "0", **flags, "topk": None}, {}
    ).algorithm_config()
    assert diloco == DiLoCoConfig(
        mode="standard", lr=1e-3, inner_steps=20, outer_lr=0.7, outer_momentum=0.9, averaging="butterfly"
    )
    assert diloco.compression == "int8" and diloco.value_bits == 8 and diloco.error_decay == 1.0
    chosen = PeerSpec.of(algorithm="diloco-eager", lr=0.01, outer_momentum=0.5).algorithm_config()
    assert (chosen.lr, chosen.outer_momentum) == (0.01, 0.5)


@pytest.mark.parametrize("mode", list(OUTER_MOMENTUM))
def test_outer_momentum_defaults_to_the_modes_and_a_config_holds_the_number(mode):
    assert DiLoCoConfig(mode=mode).outer_momentum == OUTER_MOMENTUM[mode]
    assert DiLoCoConfig(mode=mode, outer_momentum=0.0).outer_momentum == 0.0


@pytest.mark.parametrize(
    ("config", "changes", "field"),
    [
        (DeMoConfig, {"lr": 0.0}, "lr"),
        (DeMoConfig, {"lr": float("nan")}, "lr"),
        (DeMoConfig, {"topk": 0}, "topk"),
        (DeMoConfig, {"value_bits": 3}, "value_bits"),
        (DiLoCoConfig, {"mode": "lazy"}, "mode"),
        (DiLoCoConfig, {"lr": -1e-3}, "lr"),
        (DiLoCoConfig, {"inner_steps": 0}, "inner_steps"),
        (DiLoCoConfig, {"outer_lr": float("inf")}, "outer_lr"),
        (DiLoCoConfig, {"outer_momentum": 1.0}, "outer_momentum"),
        (DiLoCoConfig, {"averaging": "allreduce"}, "averaging"),
    ],
)
def test_bad_values_raise_naming_the_field_and_the_value(config, changes, field):
    (value,) = changes.values()
    with pytest.raises(ValueError, match=rf"^{field} must .*{value!r}"):
        config(**changes)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DeMoConfig().topk = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        DiLoCoConfig().mode = "eager"


def test_a_spec_built_in_code_checks_its_values_naming_the_flag():
    """Values set in code pass the checks a flag's text does, named by the flag."""
    with pytest.raises(ValueError, match=r"--algorithm: expected one of demo, .*'adam'"):
        PeerSpec.of(algorithm="adam")
    with pytest.raises(ValueError, match=r"--checkpoint-every: expected an integer in \[0, "):
        PeerSpec.of(checkpoint_every=-1)
    with pytest.raises(ValueError, match=r"--topk: topk does not apply to compression int8"):
        PeerSpec.of(algorithm="diloco", topk=8)  # each value fine, together not
    with pytest.raises(ValueError, match=r"unknown setting 'modle'"):
        PeerSpec.of(modle="tiny")
    assert PeerSpec.of(algorithm="diloco").algorithm.name == "diloco-eager"  # the alias, resolved


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        ("demo", "86dc441b9f9ada4fc3002fa5d3f2b8f2eb6fc861c4bd55f51aa357fcb76318c9"),
        ("demo-overlap", "6d04b094a81dc072ccedb2360ad10c49d63d51ab6c4b95bd9dab16d5eb4c8c53"),
        ("diloco-standard", "3225f3e79b215d1bcfe7033e273b91583abc54ae5afb55d35d994195c5b38123"),
        ("diloco-delayed", "9057d0dcdffef413f1cf5cf23863c345db62fd3d6486bd8e9677f1eba3e3ba2c"),
        ("diloco-eager", "96fe1899df49bf50fbfa5f0aa241ad2c9290bd9458f0159c8a8fb4d0b48001e4"),
    ],
)
def test_the_run_hash_is_the_one_from_before_the_typed_configs(algorithm, expected):
    """Peers of an older shoal at the same settings must stay compatible: the hashes are pinned."""
    assert run_hash(PeerSpec.of(algorithm=algorithm).run_config()) == expected


def test_a_peer_built_in_code_and_a_shoal_join_peer_at_equal_settings_share_a_run():
    """The integration tests' peers once wrote their own run configuration ("lr": "2e-3", no seed), and
    a `shoal join` peer at the same settings ("lr": "0.002", "seed": "0") would have refused them."""
    settings = resolve({"lr": "2e-3", "topk": "8", "gather": "2"}, {})
    in_code = run_config("tiny", dataclasses.replace(DEFAULTS["demo"], lr=2e-3, topk=8), gather=2)
    assert run_hash(in_code) == run_hash(settings.run_config())
    assert run_hash(run_config("tiny", DEFAULTS["demo"])) != run_hash(in_code)


def test_compression_presets_and_overrides():
    def config(**flags):
        return resolve({k: str(v) for k, v in flags.items()}, {}).algorithm_config()

    assert (config(algorithm="demo").topk, config(algorithm="demo").value_bits) == (32, 32)
    compact = config(algorithm="demo", compression="compact")
    assert (compact.topk, compact.value_bits, compact.chunk) == (4, 1, 64)
    assert config(algorithm="demo", compression="compact", topk=8).topk == 8
    sparse = config(algorithm="diloco", compression="sparse", value_bits=4, chunk=32)
    assert (sparse.compression, sparse.topk, sparse.value_bits, sparse.chunk) == ("sparse", 64, 4, 32)
    assert sparse.error_decay == SPARSE_ERROR_DECAY
    assert (sparse.outer_lr, sparse.outer_momentum) == SPARSE_OUTER  # unless given
    given = config(algorithm="diloco", compression="sparse", outer_lr=0.5, outer_momentum=0.9)
    assert (given.outer_lr, given.outer_momentum) == (0.5, 0.9)
    assert config(algorithm="diloco-eager", compression="int8", value_bits=4).value_bits == 4


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"algorithm": "demo", "compression": "sparse"}, "--compression: compression sparse is not for demo"),
        ({"algorithm": "diloco", "compression": "compact"}, "--compression"),
        ({"algorithm": "diloco", "topk": "8"}, "--topk: topk does not apply to compression int8"),
        ({"algorithm": "diloco", "compression": "lossy"}, "--compression: expected one of"),
        ({"algorithm": "demo", "value_bits": "3"}, "--value-bits: expected one of 32, 16, 8, 4, 2, 1"),
        ({"algorithm": "demo", "topk": "0"}, "--topk"),
        ({"algorithm": "demo", "topk": "5000"}, "--topk"),
        ({"algorithm": "diloco", "compression": "sparse", "chunk": "300"}, "--chunk"),
        (
            {"algorithm": "diloco", "compression": "sparse", "averaging": "butterfly"},
            "--averaging: averaging butterfly needs a dense codec",
        ),
    ],
)
def test_compression_that_does_not_fit_names_the_setting(flags, named):
    with pytest.raises(SettingsError) as error:
        resolve(flags, {})
    assert str(error.value).startswith(named), str(error.value)
