"""Checkpoints: atomic, pruned, safe to load; a DeMo peer resumes exactly where it stopped."""

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


def test_demo_peer_resumes_from_a_checkpoint_identically(tmp_path):
    torch.manual_seed(0)
    grads = [torch.randn(96, 64) for _ in range(6)]

    def fresh():
        p = torch.nn.Parameter(torch.ones(96, 64))
        return p, DeMo([p], lr=1e-2, exchange=LoopbackExchange.group(1)[0], compression_topk=4)

    p_ref, opt_ref = fresh()
    for g in grads:
        p_ref.grad = g
        opt_ref.step()
    p, opt = fresh()
    store = CheckpointStore(tmp_path)
    for r, g in enumerate(grads[:3]):
        p.grad = g
        opt.step()
        store.save(r, {"params": [p.detach()], "optimizer": opt.state_dict()})
    state = store.load_latest()
    p2, opt2 = fresh()
    with torch.no_grad():
        p2.copy_(state["params"][0])
    opt2.load_state_dict(state["optimizer"])
    for g in grads[3:]:
        p2.grad = g
        opt2.step()
    assert state["round"] == 2 and torch.equal(p2, p_ref)


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)
    with pytest.raises(ValueError, match="round"):
        CheckpointStore(tmp_path).save(-1, {})
