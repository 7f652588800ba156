"""A local Hugging Face causal LM directory as `--model DIR` (the `hf` extra): it loads without any
download, computes its next-token loss, and trains two DeMo rounds on two loopback workers that end on
the same parameters. Under CI the dev extra installs transformers, so this runs there."""

import os

import pytest
import torch

from shoal.peer.algorithms.configs import DeMoConfig
from shoal.peer.algorithms.exchange import run_loopback
from shoal.peer.models.loading import ModelError, load_model
from shoal.peer.train.trainer import Trainer

if os.environ.get("CI"):
    import transformers
else:
    transformers = pytest.importorskip("transformers")


@pytest.fixture
def gpt2_dir(tmp_path):
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    return tmp_path


def test_a_local_directory_loads_without_download_and_gives_a_loss(gpt2_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model(str(gpt2_dir))
    assert loaded.vocab_size == 256 and loaded.seq_len == 32
    tokens = torch.randint(0, 256, (2, 17))
    loss = loaded.loss_fn(loaded.module, tokens[:, :-1], tokens[:, 1:])
    assert loss.shape == () and 4.0 < loss.item() < 7.0  # about log(256) at initialization
    loss.backward()
    assert all(p.grad is not None for p in loaded.module.parameters() if p.requires_grad)


def test_two_workers_train_it_with_demo_and_agree(gpt2_dir):
    # loaded one after the other: transformers initializes under a process-wide meta-device mode, which
    # two threads loading at once would share (each peer is its own process in a swarm)
    models = [load_model(str(gpt2_dir), seed=0) for _ in range(2)]

    def work(rank, exchange):
        loaded = models[rank]
        generator = torch.Generator().manual_seed(rank)

        def batches(_step, _micro, size, _plan):
            tokens = torch.randint(0, 256, (size, 17), generator=generator)
            return tokens[:, :-1], tokens[:, 1:]

        trainer = Trainer(
            loaded.module,
            exchange,
            algorithm=DeMoConfig(),
            batches=batches,
            loss_fn=loaded.loss_fn,
            batch_size=2,
        )
        reports = trainer.run(2)
        return [r.participants for r in reports], [p.detach().clone() for p in loaded.module.parameters()]

    (seen0, params0), (seen1, params1) = run_loopback(2, work)
    assert seen0 == seen1 == [2, 2]
    assert all(torch.equal(a, b) for a, b in zip(params0, params1, strict=True))


def test_a_directory_without_config_is_refused_by_name(tmp_path):
    with pytest.raises(ModelError, match=r"without config\.json"):
        load_model(str(tmp_path))


SMALL_DECODER = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
}


@pytest.mark.parametrize(
    "config",
    [
        lambda: transformers.GPT2Config(vocab_size=256, n_positions=2048, n_embd=32, n_layer=1, n_head=2),
        lambda: transformers.LlamaConfig(**SMALL_DECODER),
        lambda: transformers.Qwen2Config(**SMALL_DECODER),
    ],
    ids=["gpt2", "llama", "qwen2"],
)
def test_a_config_without_weights_starts_fresh_alike_and_takes_its_whole_length(tmp_path, config):
    """Pretraining: a directory holding only config.json builds fresh weights from the run's seed, the
    same on every peer; the sequence length defaults to 1,024 and goes up to the model's maximum."""
    config().save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    first, second, other = (load_model(str(tmp_path), seed=s) for s in (5, 5, 6))
    weights = [next(m.module.parameters()) for m in (first, second, other)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert first.seq_len == 1024 and load_model(str(tmp_path), seq_len=2048).seq_len == 2048
    tokens = torch.randint(0, 256, (1, 2049))
    loss = first.loss_fn(first.module, tokens[:, :-1], tokens[:, 1:])
    assert 4.0 < loss.item() < 7.0
    with pytest.raises(ModelError, match=r"--seq-len 2049: .* at most 2048"):
        load_model(str(tmp_path), seq_len=2049)
