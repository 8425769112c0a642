"""Gradient compression: codecs (fp16, bf16, int8, top-k) and error feedback.

Work in progress (see docs/compression.md when it exists): the codecs and error
feedback are built and tested; the communication hooks that reduce each codec with the
right collective, PowerSGD, byte accounting in the run metrics and the CLI are not yet.
"""

from dptrain.compress.codecs import CODECS, Codec, Encoded, Half, Int8, TopK, make_codec
from dptrain.compress.feedback import ErrorFeedback

__all__ = ["CODECS", "Codec", "Encoded", "Half", "Int8", "TopK", "make_codec", "ErrorFeedback"]
