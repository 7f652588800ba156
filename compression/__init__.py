"""shoal.compression: tensor codecs that make a payload hundreds to thousands of times smaller.

    from shoal.compression import DCTTopKCodec, DenseCodec, TopKCodec
    message = DCTTopKCodec(chunk=64, topk=4, value_bits=1).encode(momentum)  # an EncodedTensor
    approx = DCTTopKCodec().decode(message)
    sparse = TopKCodec(chunk=64, topk=64, value_bits=2).encode(pseudo_gradient)  # SparseLoCo-style

Torch only, no networking. Every decoder treats its message as untrusted: a malformed one raises
`MalformedPayloadError` (with a `reason` slug) and never allocates more than `DecodeLimits` allow.
"""

from shoal.compression.codec import CODECS, Codec, DecodeLimits, check_registry, decode_tensor
from shoal.compression.dct_topk import DCTTopKCodec, TopKCoefficients
from shoal.compression.dense import DenseCodec
from shoal.compression.topk import TopKCodec
from shoal.protocol import EncodedTensor, MalformedPayloadError

check_registry()

__all__ = [
    "CODECS",
    "Codec",
    "DCTTopKCodec",
    "DecodeLimits",
    "DenseCodec",
    "EncodedTensor",
    "MalformedPayloadError",
    "TopKCodec",
    "TopKCoefficients",
    "decode_tensor",
]
