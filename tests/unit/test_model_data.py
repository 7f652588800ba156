"""The embedded model and data: shapes, initial loss, disjoint deterministic batches, the corpora."""

import math

import pytest
import torch

from shoal.peer.data import BatchPlan, stdlib_corpus, validation_batches, validation_loss
from shoal.peer.models.gpt import GPTConfig, TinyGPT


def test_initial_loss_is_near_uniform_and_gradients_flow():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.preset("tiny"))
    tokens = torch.randint(0, 256, (4, 65))
    loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    assert abs(loss.item() - math.log(256)) < 0.1
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model(tokens[:, :-1]).shape == (4, 64, 256)


def test_default_model_has_a_few_million_parameters():
    assert 2_000_000 < sum(p.numel() for p in TinyGPT(GPTConfig.preset("small")).parameters()) < 5_000_000


def test_model_is_causal():
    torch.manual_seed(1)
    model = TinyGPT(GPTConfig.preset("tiny")).eval()
    tokens = torch.randint(0, 256, (1, 32))
    changed = tokens.clone()
    changed[0, 20] = (changed[0, 20] + 1) % 256
    torch.testing.assert_close(model(tokens)[0, :20], model(changed)[0, :20])


@pytest.mark.parametrize(("kwargs", "match"), [({"n_head": 3}, "n_head"), ({"d_model": 0}, "d_model")])
def test_bad_model_config_names_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.preset("tiny", **kwargs)


def test_workers_get_disjoint_deterministic_windows():
    stream = torch.arange(10_000)
    plan = BatchPlan(seq_len=15, batch_size=4, workers=3, seed=7)
    for step in (0, 1, 50):
        starts = [set(plan.batch(stream, step, w)[0][:, 0].tolist()) for w in range(3)]
        assert all(len(s) == 4 for s in starts)
        assert not (starts[0] & starts[1] or starts[0] & starts[2] or starts[1] & starts[2])
        assert torch.equal(plan.batch(stream, step, 2)[0], plan.batch(stream, step, 2)[0])
    inputs, targets = plan.batch(stream, 3, 1)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one


def test_stdlib_corpus_is_split_by_file_and_is_bytes():
    streams = stdlib_corpus(max_bytes=2 << 20)
    assert len(streams.train) > 1_000_000 and len(streams.validation) > 10_000
    assert streams.train.max_id() < 256 and streams.vocab_size == 256
    assert stdlib_corpus(max_bytes=2 << 20).validation.digest() == streams.validation.digest()
    assert streams.digest is None  # the default corpus pins nothing in the run configuration


def test_validation_batches_are_fixed():
    batches = validation_batches(torch.arange(1000), seq_len=9, batch_size=4, batches=3)
    assert [b.shape for b in batches] == [(4, 10)] * 3


def test_validation_loss_is_the_mean_over_fixed_windows_and_keeps_the_mode():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.preset("tiny"))
    seq_len = model.config.seq_len
    stream = torch.randint(0, 256, (40 * (seq_len + 1),))

    def loss_fn(m, inputs, targets):
        return m(inputs, targets=targets)

    # 10 windows in batches of 4 (4 + 4 + 2): a mean over windows, not over batches
    windows = validation_batches(stream, seq_len, batch_size=4, batches=3)[:3]
    windows[-1] = windows[-1][:2]
    with torch.no_grad():
        expected = sum(loss_fn(model, w[:, :-1], w[:, 1:]).item() * len(w) for w in windows) / 10
    model.train()
    loss = validation_loss(model, loss_fn, stream[: 10 * (seq_len + 1)], seq_len, windows=12, batch_size=4)
    assert loss == pytest.approx(expected, rel=1e-5)
    assert model.training  # the mode it was in
    model.eval()
    assert validation_loss(model, loss_fn, stream, seq_len, windows=8, batch_size=4) == pytest.approx(
        validation_loss(model, loss_fn, stream, seq_len, windows=8, batch_size=2), rel=1e-5
    )
    assert not model.training
    assert validation_loss(model, loss_fn, stream[:seq_len], seq_len) is None  # not one window
