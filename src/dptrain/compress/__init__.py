"""Gradient compression: codecs (fp16, bf16, int8, top-k), PowerSGD and error feedback.

Work in progress (docs/compression.md): the codecs, error feedback, the DDP engine's
compression hook (:mod:`dptrain.compress.hook`) and ``dptrain run``'s ``[ddp]
compression`` (residuals checkpointed per rank) are built; ZeRO stage 2 and the studies
are not yet.
"""

from dptrain.compress.codecs import CODECS, Codec, Encoded, Half, Int8, TopK, make_codec
from dptrain.compress.feedback import ErrorFeedback
from dptrain.compress.powersgd import PowerSGD

__all__ = ["CODECS", "Codec", "Encoded", "Half", "Int8", "TopK", "make_codec", "ErrorFeedback", "PowerSGD"]
