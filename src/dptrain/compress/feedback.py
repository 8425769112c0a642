"""Error feedback: what compression dropped this step is added to the next step's gradient.

With a lossy codec C, a worker that sends C(g_t) loses e_t = g_t - C(g_t) for good.
Error feedback (Seide et al., "1-Bit Stochastic Gradient Descent", 2014; analysed as
EF-SGD by Karimireddy et al., 2019) keeps it and sends C(g_t + e_{t-1}) instead, with
e_t = g_t + e_{t-1} - C(g_t + e_{t-1}). Then the sum of what was sent over T steps is
the sum of the gradients minus the last residual, exactly:

    sum_t C(g_t + e_{t-1}) = sum_t g_t - e_T

so nothing is lost, only delayed. One residual per bucket, in fp32, the bucket's size.
A residual that would turn non-finite (a NaN or infinite gradient, whose step the
trainer skips anyway) is reset to zero rather than kept, so one bad step does not
poison every later one.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from dptrain.compress.codecs import Codec, Encoded

__all__ = ["ErrorFeedback", "finite_or_zero", "state_key"]


def finite_or_zero(residual: torch.Tensor) -> torch.Tensor:
    """``residual``, or zeros in place of it if any element is NaN or infinite.

    One reduction (NaN and infinities propagate through a sum; a finite sum that
    overflows resets the residual too, the safe side) instead of
    ``torch.isfinite(x).all()``'s four passes. On CPU the answer is read on the host; on
    an accelerator the fill is masked on the device, so no bucket waits for a host sync.
    """
    finite = torch.isfinite(residual.sum())
    if residual.device.type == "cpu":
        return residual if bool(finite) else residual.zero_()
    return residual.masked_fill_(~finite, 0.0)


class ErrorFeedback:
    """Per-key residuals (a key per bucket) for error-feedback compression."""

    def __init__(self):
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def encode(self, key: Hashable, x: torch.Tensor, codec: Codec) -> Encoded:
        """``codec.encode(x + residual)``, keeping what the encoding lost as the new residual."""
        corrected = self.correct(key, x)
        payload = codec.encode_keeping_error_(corrected)  # corrected - decode(payload), formed in place
        self.residuals[key] = finite_or_zero(corrected)
        return payload

    def correct(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """``x`` (flattened, fp32) plus the key's residual: what to encode; pass it to :meth:`keep` after.

        The sum is formed in the residual's own buffer (no allocation at steady state), so
        until :meth:`keep` the key's residual holds it.
        """
        flat = x.reshape(-1).float()
        residual = self.residuals.get(key)
        if residual is not None and residual.numel() == flat.numel():
            return residual.add_(flat)
        return flat.clone()

    def keep(self, key: Hashable, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep ``corrected - sent`` (``sent``: the decoded payload), what the encoding lost; consumes ``corrected``.

        Zero instead if that is not finite.
        """
        self.residuals[key] = finite_or_zero(corrected.sub_(sent))

    def state_dict(self) -> dict:
        return {"residuals": {str(k): v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {state_key(k): v.clone() for k, v in state["residuals"].items()}


def state_key(text: str) -> Hashable:
    """A per-bucket state key as a checkpoint spells it (a string) back to the key it was: an int index, or the name."""
    return int(text) if text.lstrip("-").isdigit() else text
