"""Checkpoints: atomic, pruned, safe to load, and an optimizer state round-trips through them."""

import pickle

import pytest
import torch

from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.demo import DeMo
from shoal.peer.exchange import LoopbackExchange


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
    assert not list(tmp_path.glob(".round-*"))  # no temporary file left behind


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(4, {"x": torch.ones(2)})
    store.save(5, {"x": torch.zeros(2)})
    (tmp_path / "round-5.pt").write_bytes((tmp_path / "round-5.pt").read_bytes()[:40])  # torn write
    assert store.load_latest()["round"] == 4


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, {"x": torch.ones(1)})
    with open(tmp_path / "round-2.pt", "wb") as file:
        pickle.dump({"round": 2, "payload": Exploit()}, file, protocol=2)
    assert store.load_latest()["round"] == 1


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    store.save(1, {"x": torch.ones(1)})

    def disk_full(obj, file):
        file.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        store.save(2, {"x": torch.ones(1)})
    assert store.rounds() == [1] and not list(tmp_path.glob(".round-*"))
    assert store.load_latest()["round"] == 1


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
