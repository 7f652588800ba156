"""`shoal join` settings: flags over SHOAL_* variables over the TOML file over defaults; bad values
exit 2 naming the setting and where it came from."""

import socket

import pytest

from shoal.peer import cli
from shoal.peer.config.settings import PeerSpec, SettingsError, resolve
from shoal.peer.swarm.identity import IdentityError, load_identity, peer_id_of


def test_flags_then_environment_then_file_then_defaults(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\nname = "small"\n[algorithm]\ntopk = 8\nlr = 0.01\n'
        '[network]\ninitial_peers = ["/ip4/10.0.0.1/tcp/1/p2p/A"]\n[checkpoint]\nevery = 3\n'
    )
    environ = {"SHOAL_TOPK": "16", "SHOAL_LR": "0.02"}
    chosen = resolve({"lr": "0.03", "model": None}, environ, str(config))
    assert chosen.algorithm.lr == 0.03  # flag
    assert chosen.algorithm.topk == 16  # environment
    assert chosen.model.name == "small" and chosen.checkpoint.every == 3  # file
    assert chosen.network.initial_peers == ("/ip4/10.0.0.1/tcp/1/p2p/A",)
    assert chosen.algorithm.name == "demo" and chosen.network.port == 0  # defaults


def test_config_file_from_the_environment(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[algorithm]\nname = "diloco"\n')
    assert resolve({}, {"SHOAL_CONFIG": str(config)}).algorithm.name == "diloco-eager"


@pytest.mark.parametrize(
    ("flags", "environ", "toml", "named"),
    [
        ({"port": "70000"}, {}, "", "--port"),
        ({"algorithm": "adam"}, {}, "", "--algorithm"),
        ({"device": "tpu"}, {}, "", "--device"),
        ({"run": "no spaces"}, {}, "", "--run"),
        ({"round_seconds": "nan"}, {}, "", "--round-seconds"),
        ({}, {"SHOAL_TOPK": "many"}, "", "SHOAL_TOPK"),
        ({}, {"SHOAL_BATCH_SIZE": "0"}, "", "SHOAL_BATCH_SIZE"),
        ({}, {}, "[algorithm]\ntopk = true\n", r"topk in \[algorithm\]"),
        ({}, {}, "[algorithm]\ninner_steps = 1.5\n", r"inner_steps in \[algorithm\]"),
        ({}, {}, "[model]\nnmae = 'tiny'\n", r"unknown setting 'nmae' in \[model\]"),
        ({}, {}, "[modle]\nname = 'tiny'\n", "unknown section 'modle'"),
        ({}, {}, "model = 'small'\n", r"'model' is now 'name' in section \[model\]"),  # the flat form
        ({}, {}, "checkpoint_every = 5\n", r"'checkpoint_every' is now 'every' in section \[checkpoint\]"),
        ({}, {}, "[model]\nname = \n", "not valid TOML"),
        ({"averaging": "allreduce"}, {}, "", "--averaging"),
        ({"averaging": "butterfly"}, {}, "", "DiLoCo only"),  # DeMo's sparse payloads cannot be cut
        ({"gather": "-1"}, {}, "", "--gather"),
        ({}, {"SHOAL_GATHER": "two"}, "", "SHOAL_GATHER"),
        ({"algorithm": "diloco", "averaging": "butterfly", "gather": "4"}, {}, "", "--gather: not with"),
    ],
)
def test_bad_values_name_the_setting(tmp_path, flags, environ, toml, named):
    config = tmp_path / "run.toml"
    config.write_text(toml)
    with pytest.raises(SettingsError, match=named):
        resolve(flags, environ, str(config))


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(SettingsError, match=r"--config .*missing\.toml"):
        resolve({}, {}, str(tmp_path / "missing.toml"))


def test_run_config_holds_what_peers_must_share():
    demo, diloco = PeerSpec.of(), PeerSpec.of(algorithm="diloco-eager", inner_steps=20)
    assert demo.run_config()["compression_topk"] == "32" and "inner_steps" not in demo.run_config()
    assert diloco.run_config()["inner_steps"] == "20" and diloco.run_config()["lr"] == "0.001"
    assert PeerSpec.of(port=1234).run_config() == demo.run_config()  # local settings are not shared
    butterfly = PeerSpec.of(algorithm="diloco-eager", inner_steps=20, averaging="butterfly")
    assert "averaging" not in diloco.run_config()  # the runs from before the setting keep their hash
    assert butterfly.run_config() == diloco.run_config() | {"averaging": "butterfly"}
    assert "gather" not in demo.run_config()  # likewise
    assert PeerSpec.of(gather=16).run_config() == demo.run_config() | {"gather": "16"}


def test_cli_exits_2_with_the_setting_named(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SHOAL_MAX_ROUNDS", "-3")
    assert cli.main(["join"]) == 2
    assert "SHOAL_MAX_ROUNDS" in capsys.readouterr().err
    monkeypatch.delenv("SHOAL_MAX_ROUNDS")
    assert cli.main(["join", "--compute-fraction", "1.5"]) == 2
    assert "--compute-fraction" in capsys.readouterr().err


def test_a_port_in_use_is_reported_before_anything_starts(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["join", "--host", "127.0.0.1", "--port", str(port)]) == 2
    assert f"--port {port}: the port is in use on 127.0.0.1" in capsys.readouterr().err


def test_keygen_writes_an_identity_once(tmp_path, capsys):
    path = tmp_path / "peer.key"
    assert cli.main(["keygen", str(path)]) == 0
    assert f"peer id {peer_id_of(path)}" in capsys.readouterr().out
    assert load_identity(path).sign(b"record")  # a usable RSA key
    assert cli.main(["keygen", str(path)]) == 1
    assert "already exists" in capsys.readouterr().err


def test_status_needs_a_peer(capsys, monkeypatch):
    monkeypatch.delenv("SHOAL_INITIAL_PEERS", raising=False)
    assert cli.main(["status"]) == 2
    assert "--initial-peers" in capsys.readouterr().err


def test_an_identity_file_that_is_not_one_is_refused(tmp_path):
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"\x0a\x05hello")
    with pytest.raises(IdentityError, match="not a shoal/hivemind identity"):
        load_identity(bad)
    with pytest.raises(IdentityError, match="shoal keygen"):
        load_identity(tmp_path / "missing.key")
