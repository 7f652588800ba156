"""The join command a peer prints always joins its run (issue 78): a first peer started with a value
other than the default for every setting its run configuration pins (`PeerSpec.run_config`, what
peers compare), and a joiner started from exactly the printed command, hold equal configurations.
The command is parsed as `shoal join` parses it."""

import argparse

import pytest

from shoal.peer.cli.join import add_arguments
from shoal.peer.config import settings
from shoal.peer.job.node import in_flags, join_command

ADDRESS = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWNgVzFCkfpsunDwrBFF6ttTHT7mybeK3WrKxuLxqRsYhm"
COMMON = ["--run", "pinned", "--model", "tiny", "--seed", "9", "--lr", "0.0007", "--seq-len", "48"]
COMMON += ["--grad-clip", "1.5", "--weight-decay", "0.05", "--until-round", "40", "--chunk", "32"]
COMMON += ["--value-bits", "8", "--gather", "2"]
DEMO = ["--algorithm", "demo", "--topk", "8"]
DILOCO = ["--algorithm", "diloco-standard", "--inner-steps", "7", "--outer-lr", "0.5"]
DILOCO += ["--outer-momentum", "0.8", "--compression", "sparse", "--topk", "16"]
SCHEDULES = [
    ["--lr-schedule", "cosine", "--warmup-rounds", "3", "--min-lr", "0.0001"],
    ["--lr-schedule", "linear", "--warmup-rounds", "2", "--decay-rounds", "11"],
    ["--lr-schedule", "wsd", "--warmup-rounds", "4", "--min-lr", "0.00002"],
    ["--lr-schedule", "constant", "--warmup-rounds", "5"],
]


def spec(argv: list[str]) -> settings.PeerSpec:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings.resolve(vars(parser.parse_args(argv)), {}, None)


@pytest.mark.parametrize("algorithm", [DEMO, DILOCO], ids=["demo", "diloco"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[1] for s in SCHEDULES])
def test_the_printed_join_command_pins_every_setting_of_the_run(algorithm, schedule):
    first = spec([*COMMON, *algorithm, *schedule])
    command = join_command(first, ADDRESS, run_key="ab" * 32)
    assert command.startswith(f"shoal join --initial-peers {ADDRESS} --run pinned --model tiny ")
    joiner = spec(command.split()[2:])
    assert joiner.run_config() == first.run_config()
    assert joiner.flag("trust_key") is not None
    # every entry was set away from its default here, so the test covers each one it pins
    default = settings.PeerSpec.of(algorithm=first.flag("algorithm")).run_config()
    moved = {k for k, v in first.run_config().items() if default.get(k) != v}
    assert moved == first.run_config().keys() - {"model", "algorithm"}, sorted(first.run_config())


def test_a_run_at_its_defaults_prints_the_run_the_model_and_the_algorithm_alone():
    command = join_command(spec(["--run", "plain"]), ADDRESS)
    assert command == f"shoal join --initial-peers {ADDRESS} --run plain --model tiny --algorithm demo"


def test_a_refusal_names_the_until_round_flag_with_its_own_values():
    said = in_flags("total_rounds is 41 there, 21 here; topk is 4 there, the default here")
    assert said == "--until-round 40 in the run, 20 here; --topk 4 in the run, its default here"
