"""The embedded default model: a small byte-level GPT (causal transformer), nanoGPT-style.

    model = TinyGPT(GPTConfig.preset("small"))     # ~3.2M parameters
    loss = model(tokens[:, :-1], targets=tokens[:, 1:])

Byte-level (vocabulary 256) so that any text trains without a tokenizer download. Pre-norm blocks,
causal attention through `scaled_dot_product_attention`, GELU MLP, tied input/output embeddings.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Shape of a TinyGPT."""

    vocab_size: int = 256
    """Token ids are in [0, vocab_size); 256 for bytes."""
    seq_len: int = 128
    """Longest context, in tokens."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    d_model: int = 256
    """Width of the residual stream."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.n_head ({self.n_head}) must divide d_model ({self.d_model})")

    @staticmethod
    def preset(name: str, **overrides: int) -> "GPTConfig":
        """`tiny` (~0.1M params, for tests), `small` (~3.2M, the default), `base` (~25M)."""
        presets = {
            "tiny": {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 64},
            "small": {"n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 128},
            "base": {"n_layer": 8, "n_head": 8, "d_model": 512, "seq_len": 256},
        }
        if name not in presets:
            raise ValueError(f"unknown model size {name!r}; choose one of {', '.join(presets)}")
        return GPTConfig(**{**presets[name], **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, head, time, head_dim)
        q, k, v = (t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model, bias=False),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A causal language model over `config.vocab_size` tokens."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.d_model)
        self.checkpointing = False
        """Activation checkpointing: each block's activations recomputed in the backward pass."""
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, time, vocab), or the mean cross-entropy if `targets` (batch, time) are given."""
        time = tokens.shape[1]
        if time > self.config.seq_len:
            raise ValueError(f"sequence of {time} tokens exceeds seq_len {self.config.seq_len}")
        positions = torch.arange(time, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.norm(x) @ self.token_embedding.weight.T  # tied embeddings
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
