"""How DiLoCo's pseudo-gradients travel: the codec a run's `--compression` names (`codec_for`), and the
error feedback that keeps what the codec dropped for the next round (`ErrorFeedback`)."""

import torch

from shoal.compression import Codec, DenseCodec, TopKCodec
from shoal.peer.algorithms.configs import DiLoCoConfig
from shoal.protocol import Payload


def codec_for(config: DiLoCoConfig) -> Codec:
    """The codec of a run's `--compression`: int8 sends every value (blocks of `chunk` sharing a scale),
    sparse the top-k of every chunk (shoal.compression.TopKCodec), both at `value_bits`."""
    if config.compression == "sparse":
        return TopKCodec(chunk=config.chunk, topk=config.topk, value_bits=config.value_bits)
    return DenseCodec(config.value_bits, block=config.chunk)


class ErrorFeedback:
    """A codec with error feedback: what it dropped of one pseudo-gradient is added, times `decay`, to
    the next (the `residuals`). No codec: float32, exact, nothing kept."""

    def __init__(self, codec: Codec | None, params: list[torch.Tensor], decay: float):
        self.codec = codec if codec is not None else DenseCodec(value_bits=32, zstd=False)
        self.decay = decay
        self.residuals = [torch.zeros_like(p) for p in params] if codec is not None else None

    def encode(self, pseudo: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
        """The payload of `pseudo` (to which the residuals are added, in place), and what every
        receiver decodes of it; keeps what the codec dropped."""
        if self.residuals is not None:
            pseudo = [d.add_(r, alpha=self.decay) for d, r in zip(pseudo, self.residuals, strict=True)]
        payload = Payload(tensors=[self.codec.encode(d) for d in pseudo])
        decoded = [
            self.codec.decode(m, device=d.device).to(d.dtype)
            for m, d in zip(payload.tensors, pseudo, strict=True)
        ]
        if self.residuals is not None:
            for r, d, sent in zip(self.residuals, pseudo, decoded, strict=True):
                torch.sub(d, sent, out=r)
        return payload.SerializeToString(), decoded

    def reset(self) -> None:
        """Forgets what was dropped (after a diverged phase, whose residuals are poisoned too)."""
        for r in self.residuals or ():
            r.zero_()
