"""Whether a model fits the device (shoal.peer.train.fit): the estimate against a dry run's measured peak,
within 15%, for the embedded GPT and Hugging Face configurations under DeMo and DiLoCo, with and without
activation checkpointing; the fit's choice under a tight budget; a refusal with the numbers; the dry
run leaving the model and the random generators as they were; the live-tensor tracker itself."""

import dataclasses

import pytest
import torch
import transformers

from shoal.peer.algorithms.configs import DEFAULTS
from shoal.peer.models.loading import load_model, recomputing
from shoal.peer.train import fit

ALGORITHMS = ["demo", "demo-overlap", "diloco-standard", "diloco-eager"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(folder)
    return load_model(str(folder))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4).save_pretrained(
        folder
    )
    return load_model(str(folder))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("name", ["tiny", "gpt2", "llama"])
def test_the_estimate_is_within_15_percent_of_the_dry_runs_peak(request, name, algorithm):
    loaded = load_model("tiny") if name == "tiny" else request.getfixturevalue(name)
    for batch_size, checkpointing in [(1, False), (8, False), (8, True)]:
        trial = fit.measure(
            loaded, DEFAULTS[algorithm], torch.device("cpu"), batch_size, checkpointing=checkpointing
        )
        ratio = trial.estimate.total / trial.measured
        assert 0.85 <= ratio <= 1.15, (name, algorithm, batch_size, checkpointing, trial)
        assert trial.round_s > 0


def test_a_tight_budget_gets_a_smaller_micro_batch_or_checkpointing(gpt2):
    algorithm = DEFAULTS["demo"]
    whole = fit.estimate(gpt2, algorithm, 8).total
    budget_gib = 1.05 * fit.estimate(gpt2, algorithm, 4).total / (1 << 30)
    fitted = fit.fit(
        gpt2, algorithm, device=torch.device("cpu"), batch_size=8, window_s=None, max_memory_gib=budget_gib
    )
    assert fitted.chosen.measured <= fitted.budget < whole
    assert (fitted.batch_size, fitted.checkpointing) in {(4, False), (8, True)}, fitted
    assert not fitted.late and "fits: micro-batch" in fitted.describe()
    record = fitted.record()
    assert record["batch_size"] == fitted.batch_size and record["measured_bytes"] == fitted.chosen.measured


def test_nothing_that_fits_is_refused_with_the_numbers():
    loaded = load_model("tiny")
    with pytest.raises(fit.FitError) as refused:
        fit.fit(
            loaded,
            DEFAULTS["demo"],
            device=torch.device("cpu"),
            batch_size=8,
            window_s=5.0,
            max_memory_gib=1e-3,
        )
    said = str(refused.value)
    assert "does not fit in 1.0 MiB" in said and "one sample needs" in said and "--max-memory" in said


def test_a_device_too_slow_for_the_window_is_a_late_fit_at_one_sample():
    loaded = load_model("tiny")
    fitted = fit.fit(
        loaded, DEFAULTS["diloco-standard"], device=torch.device("cpu"), batch_size=4, window_s=1e-6
    )
    assert fitted.late and fitted.batch_size == 1
    assert [t.estimate.batch_size for t in fitted.trials] == [4, 2, 1]
    assert "its 10 inner steps" in fitted.lateness() and "longer rounds" in fitted.lateness()


def test_the_dry_run_leaves_the_model_and_the_random_generators_as_they_were(gpt2):
    before = {k: v.clone() for k, v in gpt2.module.state_dict().items()}
    state = torch.get_rng_state()
    fit.measure(gpt2, DEFAULTS["diloco-eager"], torch.device("cpu"), 2, checkpointing=True)
    after = gpt2.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in gpt2.module.parameters())
    assert recomputing(gpt2.module) is False


def test_live_tensors_counts_what_is_alive_and_its_peak():
    device = torch.device("cpu")
    kept = torch.zeros(1000)
    with fit.LiveTensors(device, [kept]) as live:
        a = torch.ones(1000)
        b = a * 2
        assert live.bytes == 3 * 4000
        del a, b
        assert live.bytes == 4000
        c = torch.empty(10)
        c.resize_(2000)  # grown in place
        assert live.bytes == 4000 + 8000
    assert live.peak == 12000


def test_a_model_fake_tensors_cannot_run_is_traced_on_one_real_sample():
    """A forward pass that reads a value (here `.item()`) cannot run on fake tensors: its activations
    are traced on one real sample, times the batch, and the estimate still holds."""
    tiny = load_model("tiny")

    def reading_loss(model, inputs, targets):
        assert inputs.max().item() < 256  # a value read on the host
        return tiny.loss_fn(model, inputs, targets)

    reading = dataclasses.replace(tiny, loss_fn=reading_loss)
    trial = fit.measure(reading, DEFAULTS["demo"], torch.device("cpu"), 8)
    assert 0.85 <= trial.estimate.total / trial.measured <= 1.15, trial


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["tiny", "gpt2"])
def test_the_estimate_follows_the_autocast_the_peer_trains_in(request, name, precision):
    from shoal.peer.train.hardware import autocast_for

    loaded = load_model("tiny") if name == "tiny" else request.getfixturevalue(name)
    autocast = autocast_for(torch.device("cpu"), precision)
    for checkpointing in (False, True):
        trial = fit.measure(
            loaded, DEFAULTS["demo"], torch.device("cpu"), 8, checkpointing=checkpointing, autocast=autocast
        )
        assert 0.85 <= trial.estimate.total / trial.measured <= 1.15, (checkpointing, trial)
        assert (
            trial.estimate.total
            < fit.estimate(loaded, DEFAULTS["demo"], 8, checkpointing=checkpointing).total
        )
