"""Checkpoints: atomic, pruned, safe to load, and an optimizer state round-trips through them."""

import pickle

import pytest
import torch

from shoal.peer import checkpoint
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.checkpoint import CheckpointStore, CheckpointWriteError


class Exploit:
    def __reduce__(self):
        return (exec, ("raise SystemExit('code ran while loading a checkpoint')",))


def test_keeps_the_newest_and_loads_the_latest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for r in (1, 2, 3):
        store.save(r, {"weights": torch.full((3,), float(r))})
    assert store.rounds() == [2, 3]
    latest = store.load_latest()
    assert latest["round"] == 3 and torch.equal(latest["weights"], torch.full((3,), 3.0))
    assert not list(tmp_path.glob(".round-*.tmp"))  # no temporary file left behind


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(4, {"x": torch.ones(2)})
    store.save(5, {"x": torch.zeros(2)})
    (tmp_path / "round-5.safetensors").write_bytes(
        (tmp_path / "round-5.safetensors").read_bytes()[:40]
    )  # torn write
    assert store.load_latest()["round"] == 4 and store.loaded_round == 4


def test_a_damaged_checkpoint_is_named_set_aside_and_never_kept(tmp_path):
    told: list[str] = []
    store = CheckpointStore(tmp_path, keep=3, warn=told.append)
    for r in (32, 33, 34):
        store.save(r, {"x": torch.full((2,), float(r))})
    (tmp_path / "round-34.safetensors").write_bytes(
        (tmp_path / "round-34.safetensors").read_bytes()[:100]
    )  # truncated
    assert store.load_latest()["round"] == 33 and store.loaded_round == 33
    assert (
        len(told) == 1
        and str(tmp_path / "round-34.safetensors") in told[0]
        and "round-34.safetensors.damaged" in told[0]
    )
    assert (tmp_path / "round-34.safetensors.damaged").exists() and store.rounds() == [32, 33]
    store.save(35, {"x": torch.ones(2)})
    assert store.rounds() == [32, 33, 35]  # the damaged file took no good checkpoint's place
    assert CheckpointStore(tmp_path).load_latest()["round"] == 35


def test_a_checkpoint_holding_another_round_is_set_aside(tmp_path):
    told: list[str] = []
    store = CheckpointStore(tmp_path, warn=told.append)
    store.save(1, {"x": torch.ones(1)})
    store.save(2, {"x": torch.ones(1)})
    (tmp_path / "round-9.safetensors").write_bytes(
        (tmp_path / "round-2.safetensors").read_bytes()
    )  # copied by hand
    assert store.load_latest()["round"] == 2
    assert "it holds round 2" in told[0] and (tmp_path / "round-9.safetensors.damaged").exists()


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, {"x": torch.ones(1)})
    with open(tmp_path / "round-2.safetensors", "wb") as file:
        pickle.dump({"round": 2, "payload": Exploit()}, file, protocol=2)
    assert store.load_latest()["round"] == 1


def _disk_full(tensors, metadata=None):
    raise OSError(28, "No space left on device")  # inside the atomic write, its temporary file open


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    store.save(1, {"x": torch.ones(1)})

    monkeypatch.setattr(checkpoint, "save", _disk_full)
    with pytest.raises(CheckpointWriteError, match="No space") as error:
        store.save(2, {"x": torch.ones(1)})
    assert str(tmp_path) in str(error.value) and "round-1.safetensors is the newest intact one" in str(
        error.value
    )
    assert store.rounds() == [1] and not list(tmp_path.glob(".round-*.tmp"))
    assert store.load_latest()["round"] == 1


def test_a_failed_write_is_a_counted_warning_for_a_store_that_warns(tmp_path, monkeypatch):
    told: list[str] = []
    store = CheckpointStore(tmp_path, warn=told.append)
    store.save(1, {"x": torch.ones(1)})
    monkeypatch.setattr(checkpoint, "save", _disk_full)
    assert store.save(2, {"x": torch.ones(1)}) is None
    assert store.write_failures == 1 and store.last_write_failed
    assert "--checkpoint-dir" in told[0] and "training goes on" in told[0]
    monkeypatch.undo()
    assert store.save(3, {"x": torch.ones(1)}) is not None and not store.last_write_failed
    assert store.rounds() == [1, 3]


def test_an_optimizer_state_survives_the_store_unchanged(tmp_path):
    """What a resumed DeMo peer loads is exactly what it saved (resuming from a state dict is
    bit-identical: tests/unit/test_demo.py)."""
    p = torch.nn.Parameter(torch.ones(96, 64))
    opt = DeMo([p], lr=1e-2, exchange=LoopbackExchange.group(1)[0], compression_topk=4)
    p.grad = torch.randn(96, 64)
    opt.step()
    CheckpointStore(tmp_path).save(7, {"params": [p.detach()], "optimizer": opt.state_dict()})
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded["round"] == 7 and torch.equal(loaded["params"][0], p.detach())
    saved_state, loaded_state = opt.state_dict()["state"], loaded["optimizer"]["state"]
    assert saved_state.keys() == loaded_state.keys()
    for key, entry in saved_state.items():
        assert torch.equal(entry["delta"], loaded_state[key]["delta"])


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)
    with pytest.raises(ValueError, match="round"):
        CheckpointStore(tmp_path).save(-1, {})


def test_an_older_pickled_checkpoint_is_named_and_never_read(tmp_path):
    told: list[str] = []
    torch.save({"round": 4, "x": torch.ones(1)}, tmp_path / "round-4.pt")
    assert CheckpointStore(tmp_path, warn=told.append).load_latest() is None
    assert len(told) == 1 and "round-4.pt" in told[0] and "not read" in told[0]
