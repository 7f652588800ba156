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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shoal.peer.models.gpt import GPTConfig, TinyGPT

PRESETS = ("tiny", "small", "base")
FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
HF_DEFAULT_SEQ_LEN = 1024
"""A Hugging Face model's sequence length when --seq-len does not say: its maximum, at most this."""
EMBEDDED_MAX_SEQ_LEN = 1 << 16
WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""loss_fn(model, inputs, targets) -> scalar loss."""


def model_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default loss: models whose `forward(inputs, targets=...)` returns it (TinyGPT)."""
    return model(inputs, targets=targets)


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


def load_model(spec: str, *, seed: int = 0, seq_len: int | None = None) -> LoadedModel:
    """The model `spec` names, built under `seed`; `seq_len` (--seq-len): the tokens of a sample, at
    most the model's maximum (None: the embedded presets' own, a Hugging Face model's maximum up to
    HF_DEFAULT_SEQ_LEN, a factory module's `seq_len`). ModelError if it cannot be built."""
    torch.manual_seed(seed)
    if spec in PRESETS:
        if seq_len is not None and not 1 <= seq_len <= EMBEDDED_MAX_SEQ_LEN:
            raise ModelError(f"--seq-len {seq_len}: the embedded GPT takes 1 to {EMBEDDED_MAX_SEQ_LEN}")
        config = GPTConfig.preset(spec, **({} if seq_len is None else {"seq_len": seq_len}))
        return LoadedModel(TinyGPT(config), model_loss, config.seq_len, config.vocab_size)
    if Path(spec).is_dir():
        loaded = _hugging_face(Path(spec), seed)
        seq_len = min(loaded.seq_len, HF_DEFAULT_SEQ_LEN) if seq_len is None else seq_len
    elif FACTORY.match(spec):
        loaded = _factory(spec)
    else:
        raise ModelError(
            f"--model {spec}: expected one of {', '.join(PRESETS)}, a module:factory, "
            "or a Hugging Face model directory"
        )
    if seq_len is None:
        return loaded
    if not 1 <= seq_len <= loaded.seq_len:
        raise ModelError(
            f"--seq-len {seq_len}: --model {spec} takes at most {loaded.seq_len} tokens a sample"
        )
    return LoadedModel(loaded.module, loaded.loss_fn, seq_len, loaded.vocab_size)


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


def _hugging_face(path: Path, seed: int) -> LoadedModel:
    """A causal LM directory: its weights, or without any (a config alone, to pretrain) fresh weights
    drawn under the run's `seed`, the same on every peer. Its sequence length: its maximum."""
    if not (path / "config.json").is_file():
        raise ModelError(f"--model {path}: a directory without config.json is not a Hugging Face model")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ModelError(
            f"--model {path}: Hugging Face models need the transformers extra: pip install 'shoal[hf]'"
        ) from None
    try:
        if any((path / name).is_file() for name in WEIGHTS):
            module = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        else:
            torch.manual_seed(seed)
            module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError, KeyError) as error:
        raise ModelError(f"--model {path}: transformers cannot build it: {error}") from None
    # the config object maps each architecture's own names (GPT-2's n_positions) to the common ones
    positions = getattr(module.config, "max_position_embeddings", None) or HF_DEFAULT_SEQ_LEN
    vocab_size = getattr(module.config, "vocab_size", None)
    return LoadedModel(module, causal_lm_loss, int(positions), int(vocab_size) if vocab_size else None)


def causal_lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a Hugging Face causal LM (its `logits`)."""
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def recomputing(module: nn.Module) -> bool | None:
    """Whether the model recomputes its activations in the backward pass (activation checkpointing);
    None for a model that cannot (neither the embedded GPT nor a Hugging Face model)."""
    if isinstance(module, TinyGPT):
        return module.checkpointing
    if hasattr(module, "is_activation_checkpointing"):  # transformers 5.2x; older: gradient_...
        return bool(module.is_activation_checkpointing)
    if hasattr(module, "gradient_checkpointing_enable"):
        return bool(module.is_gradient_checkpointing)
    return None


def recompute(module: nn.Module, on: bool) -> None:
    """Switches activation checkpointing on or off (`recomputing` is not None): the embedded GPT's
    blocks, or a Hugging Face model's own, non-reentrant."""
    # a Hugging Face model's methods below: torch's stubs type a Module's attributes as Tensor | Module
    if isinstance(module, TinyGPT):
        module.checkpointing = on
    elif hasattr(module, "activation_checkpointing_enable"):
        if on:
            module.activation_checkpointing_enable({"use_reentrant": False})  # type: ignore[operator]
        else:
            module.activation_checkpointing_disable()  # type: ignore[operator]
    elif on:
        module.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        module.gradient_checkpointing_disable()  # type: ignore[operator]
