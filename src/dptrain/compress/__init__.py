"""Gradient compression: codecs (fp16, bf16, int8, top-k), PowerSGD and error feedback.

Layered like the rest of dptrain: codecs and error feedback at the bottom; the
collectives that suit each codec (:mod:`~dptrain.compress.sharded`'s exchange of encoded
shards, and those inside the hook); then the two users, the DDP engine's hook
(:mod:`~dptrain.compress.hook`) and ZeRO's reduce-scatter (:mod:`~dptrain.compress.zero`).
``dptrain run`` selects them with ``compression.method`` (docs/compression.md).
"""

from dptrain.compress.codecs import CODECS, Codec, Encoded, Half, Int8, TopK, make_codec
from dptrain.compress.feedback import ErrorFeedback
from dptrain.compress.powersgd import PowerSGD

__all__ = ["CODECS", "Codec", "Encoded", "Half", "Int8", "TopK", "make_codec", "ErrorFeedback", "PowerSGD"]
