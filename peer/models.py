"""What `--model` names: the embedded GPT in several sizes, a user's `module:factory`, or a local
Hugging Face causal LM directory (with the optional `transformers` extra).

A factory is any callable `module.path:name` taking no argument and returning either a module whose
`forward(inputs, targets=...)` returns the mean loss, or a `(module, loss_fn)` pair with
`loss_fn(module, inputs, targets) -> loss`. Inputs and targets are (batch, seq_len) token ids,
targets shifted by one. The module may set `seq_len` (default 128). Every peer builds the model
under the same torch seed, so that peers that start together start equal.
"""

import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shoal.peer.model import GPTConfig, TinyGPT
from shoal.peer.trainer import LossFn, model_loss

PRESETS = ("tiny", "small", "base")
FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ModelError(ValueError):
    """`--model` names nothing that can be built; the message says what was tried."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    module: nn.Module
    loss_fn: LossFn
    seq_len: int
    vocab_size: int | None
    """Token ids the model accepts (None: unknown)."""

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def load_model(spec: str, *, seed: int = 0) -> LoadedModel:
    torch.manual_seed(seed)
    if spec in PRESETS:
        config = GPTConfig.preset(spec)
        return LoadedModel(TinyGPT(config), model_loss, config.seq_len, config.vocab_size)
    if Path(spec).is_dir():
        return _hugging_face(Path(spec))
    if FACTORY.match(spec):
        return _factory(spec)
    raise ModelError(
        f"--model {spec}: expected one of {', '.join(PRESETS)}, a module:factory, "
        "or a Hugging Face model directory"
    )


def _factory(spec: str) -> LoadedModel:
    module_name, name = spec.split(":")
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ModelError(f"--model {spec}: {error}") from None
    built = factory()
    module, loss_fn = built if isinstance(built, tuple) else (built, model_loss)
    if not isinstance(module, nn.Module) or not callable(loss_fn):
        raise ModelError(f"--model {spec}: the factory must return a torch module or (module, loss_fn)")
    seq_len = getattr(module, "seq_len", 128)
    vocab_size = getattr(module, "vocab_size", None)
    return LoadedModel(module, loss_fn, int(seq_len), vocab_size)


def _hugging_face(path: Path) -> LoadedModel:
    if not (path / "config.json").is_file():
        raise ModelError(f"--model {path}: a directory without config.json is not a Hugging Face model")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ModelError(
            f"--model {path}: Hugging Face models need the transformers extra: pip install 'shoal[hf]'"
        ) from None
    module = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    # the config object maps each architecture's own names (GPT-2's n_positions) to the common ones
    positions = getattr(module.config, "max_position_embeddings", None) or 512
    vocab_size = getattr(module.config, "vocab_size", None)
    return LoadedModel(
        module, causal_lm_loss, min(int(positions), 512), int(vocab_size) if vocab_size else None
    )


def causal_lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a Hugging Face causal LM (its `logits`)."""
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
