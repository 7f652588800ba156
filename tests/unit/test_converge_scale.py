"""`shoal bench converge --scale`'s sweep (shoal.peer.bench.scale): the same rule for every method, a
record that a stopped sweep resumes from, curves against tokens and bytes, and the parity table."""

import dataclasses
import itertools
import json

import pytest

from shoal.peer.bench import scale
from shoal.peer.bench.converge import ConvergeConfig
from shoal.peer.data import stdlib_corpus

TINY = ConvergeConfig(
    model="tiny", steps=4, batch_size=2, inner_steps=2, eval_every=2, eval_batches=1, warmup=1, cosine=True
)


@pytest.fixture(scope="module")
def streams():
    return stdlib_corpus(max_bytes=1 << 20)


def test_every_method_gets_three_rates_an_edge_step_and_its_knob_and_a_rerun_reads_the_record(
    tmp_path, streams, monkeypatch
):
    record = tmp_path / "runs.jsonl"
    methods = ("adamw_dp", "demo_compact", "diloco_sparse")
    runs = scale.sweep(methods, TINY, streams, record)
    for method in methods:
        plan, found = scale.SWEEPS[method], runs[method]
        lrs = [run.settings[plan.lr_field] for run in found[:3]]
        assert lrs == list(plan.lrs)
        best = min(found[:3], key=lambda run: run.final_val_loss).settings[plan.lr_field]
        at_edge = best in (min(plan.lrs), max(plan.lrs))
        assert len(found) == 3 + at_edge + len(plan.knobs)
    # DiLoCo's inner AdamW runs at AdamW-DP's best rate
    adamw_best = min(runs["adamw_dp"], key=lambda run: run.final_val_loss).settings["adamw_lr"]
    assert all(run.settings["adamw_lr"] in (adamw_best, adamw_best / 2) for run in runs["diloco_sparse"])
    # curves: every eval_every steps and the end, tokens and bytes growing
    curve = runs["demo_compact"][0].curve
    assert [point[0] for point in curve] == [2 * TINY.tokens_per_step, 4 * TINY.tokens_per_step]
    assert 0 < curve[0][1] < curve[1][1] == runs["demo_compact"][0].bytes_sent_per_worker
    lines = record.read_text().splitlines()
    assert len(lines) == sum(len(found) for found in runs.values())

    def never(*args):
        raise AssertionError("a recorded run was run again")

    monkeypatch.setattr(scale, "run_method", never)
    again = scale.sweep(methods, TINY, streams, record)
    keys = {m: [r.key for r in found] for m, found in runs.items()}
    assert {m: [r.key for r in found] for m, found in again.items()} == keys
    other = dataclasses.replace(TINY, seed=1)  # other settings: not the record's runs
    assert scale.run_key("adamw_dp", other, streams.digest) != runs["adamw_dp"][0].key

    # --report: what the record holds, a sweep cut at its first run missing, nothing run
    partial = tmp_path / "partial.jsonl"
    partial.write_text("\n".join(lines[:2]) + "\n")
    assert scale.sweep(methods, TINY, streams, tmp_path / "none.jsonl", run=False) == {}
    cut = scale.sweep(methods, TINY, streams, partial, run=False)
    assert {m: [r.key for r in found] for m, found in cut.items()} == {"adamw_dp": keys["adamw_dp"][:2]}

    result = scale.report(runs, TINY, streams)
    assert [row["comparison"] for row in result["parity"]] == ["DeMo compact / AdamW-DP"]
    ratio = result["best"]["demo_compact"]["final_val_loss"] / result["best"]["adamw_dp"]["final_val_loss"]
    assert result["parity"][0]["ratio"] == pytest.approx(ratio)
    json.dumps(result)  # what --json prints


def test_every_method_warms_up_then_decays_along_a_cosine_to_a_tenth():
    import torch

    from shoal.peer.bench.converge import _scheduled

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    config = dataclasses.replace(TINY, steps=6, warmup=2)
    lrs = [optimizer.param_groups[0]["lr"] for _ in _scheduled(optimizer, config, iter(range(6)))]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == pytest.approx(1.0)
    assert all(a > b for a, b in itertools.pairwise(lrs[2:])) and lrs[-1] > 0.1


def test_the_lion_reference_steps_by_the_sign_of_the_interpolated_momentum_and_decays_decoupled():
    import torch

    from shoal.peer.bench.converge import _Lion

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    optimizer = _Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=1.0)
    momentum = torch.tensor([0.0, 0.0, 0.0])
    expected = p.detach().clone()
    for grad in (torch.tensor([0.3, -0.1, 0.0]), torch.tensor([-1.0, -0.5, 0.2])):
        p.grad = grad.clone()
        optimizer.step()
        update = (0.9 * momentum + 0.1 * grad).sign()
        expected = expected * (1 - 0.1 * 1.0) - 0.1 * update
        momentum = 0.99 * momentum + 0.01 * grad
        assert torch.allclose(p.detach(), expected)
    # the second step's first coordinate: momentum 0.003 against gradient -1.0, the gradient wins
    assert expected[0] == pytest.approx(((1.0 * 0.9 - 0.1) * 0.9) + 0.1)
