"""4-bit codecs for DiLoCo's pseudo-gradients: two values a byte, one fp32 scale per chunk.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication")
sends its outer gradients in 4 bits, E3M0, and accumulates them in fp32: the quality holds
because an outer gradient is the sum of H inner steps, and what a rounding loses comes back
through error feedback (:mod:`dptrain.compress.feedback`) at the next outer step. Both codecs
here take a chunk of ``chunk`` elements at a time, scaled by its absolute maximum ``a``:

- ``int4``: 15 evenly spaced levels, ``a * k / 7`` for k in -7..7, round to nearest;
- ``e3m0``: a sign bit and 3 exponent bits, no mantissa: ``+-a * 2**-e`` for e in 0..6,
  and 0 (the eighth exponent code). Each value rounds to the nearest level in linear terms
  (the midpoint of 2**-(e+1) and 2**-e is 0.75 * 2**-e), so from 0.75 * 2**-6 * a up a
  value's error is at most a third of it: a relative precision, where int4's is absolute.
  Below, values round to 2**-6 * a or, under 2**-7 * a, to 0.

A code is a nibble (int4: k + 8; e3m0: sign * 8 + e); two codes pack into a byte, the
first value in the low nibble. The payload is (packed bytes, fp32 scales): ``numel / 2 + 4
numel / chunk`` bytes, 4.25 bits a value at the default chunk of 128. A chunk holding a
NaN or an infinity gets a NaN scale and decodes to NaN, as int8's does
(:class:`~dptrain.compress.codecs.Int8`): a bad outer gradient is not made finite.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from dptrain.compress.codecs import Codec, Encoded

__all__ = ["Int4", "E3M0", "FOUR_BIT"]

_LN2 = math.log(2.0)


class _FourBit(Codec):
    """The chunking, scaling and nibble packing both codecs share; a subclass maps ``|x| / a`` to codes and back."""

    def __init__(self, chunk: int = 128):
        if chunk < 2 or chunk % 2:
            raise ValueError(f"a 4-bit codec's chunk must be an even number of elements >= 2, got {chunk}")
        self.chunk = chunk

    @abstractmethod
    def _codes(self, ratio: torch.Tensor) -> torch.Tensor:
        """Codes 0..15 (float) of ``x / a`` in [-1, 1]."""

    @abstractmethod
    def _levels(self) -> torch.Tensor:
        """The 16 values ``x / a`` a code stands for."""

    def encode(self, x: torch.Tensor) -> Encoded:
        flat = x.reshape(-1).float()
        n = flat.numel()
        pad = (-n) % self.chunk
        blocks = (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(-1, self.chunk)
        absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg())
        finite = torch.isfinite(absmax)
        safe = torch.where(finite & (absmax > 0), absmax, torch.ones_like(absmax))
        ratio = (blocks / safe[:, None]).clamp_(-1.0, 1.0).nan_to_num_(0.0)
        codes = self._codes(ratio).to(torch.uint8).view(-1, 2)
        packed = codes[:, 0] | (codes[:, 1] << 4)
        scale = torch.where(finite, absmax, torch.full_like(absmax, float("nan")))
        return Encoded((packed, scale), n)

    def decode(self, payload: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale = payload.tensors
        n = payload.numel
        codes = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1).long()
        values = self._levels().to(packed.device)[codes].view(-1, self.chunk).mul_(scale[:, None]).reshape(-1)[:n]
        return values if out is None else out.copy_(values)

    def rescale_(self, payload: Encoded, factor: float) -> Encoded:
        """The payload of ``factor * x`` from the payload of ``x``, in place (``factor`` > 0): the scales times it."""
        payload.tensors[1].mul_(factor)
        return payload

    def wire_bytes(self, numel: int) -> int:
        chunks = math.ceil(numel / self.chunk)
        return chunks * self.chunk // 2 + 4 * chunks


class Int4(_FourBit):
    """Per-chunk absmax int4: ``round(7 x / a)`` in -7..7."""

    name = "int4"

    def _codes(self, ratio: torch.Tensor) -> torch.Tensor:
        return ratio.mul_(7.0).round_().add_(8.0)

    def _levels(self) -> torch.Tensor:
        return (torch.arange(16, dtype=torch.float32) - 8.0).clamp_(min=-7.0) / 7.0


class E3M0(_FourBit):
    """Sign and a power of two, ``+-a * 2**-e`` (e in 0..6) or 0, rounded to the nearest level."""

    name = "e3m0"

    def _codes(self, ratio: torch.Tensor) -> torch.Tensor:
        magnitude = ratio.abs()
        # nearest level: 2**-e for e = ceil(-log2(m) - log2(4/3)), the midpoints at 0.75 * 2**-e; 0 below 2**-7
        e = torch.log(magnitude.clamp(min=2.0 ** -8)).div_(-_LN2).sub_(math.log2(4.0 / 3.0)).ceil_().clamp_(0.0, 6.0)
        e = torch.where(magnitude < 2.0 ** -7, torch.full_like(e, 7.0), e)
        return e.add_((ratio < 0).float().mul_(8.0))

    def _levels(self) -> torch.Tensor:
        e = torch.arange(8, dtype=torch.float32)
        magnitude = torch.where(e < 7, torch.pow(2.0, -e), torch.zeros(8))
        return torch.cat([magnitude, -magnitude])


FOUR_BIT = {"int4": Int4, "e3m0": E3M0}
