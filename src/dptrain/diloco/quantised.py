"""The reduction of pseudo-gradients in a codec the DDP hook does not take (the 4-bit ones,
:mod:`dptrain.compress.fourbit`), summed in fp32, with error feedback.

Quantised values cannot be added on the wire (their scales differ), so every rank decodes
and sums in fp32, in rank order, and every rank holds the same mean:

- on 2 ranks, one all-gather of the ranks' encodings: each rank sends its payload once,
  a ring all-reduce's share, and the mean is quantised once;
- beyond, two phases, as the DDP hook's int8 reduction (:mod:`dptrain.compress.hook`):
  each rank's pseudo-gradient cut into the group's shards and each shard encoded; an
  all-to-all sends shard j to rank j, which decodes the M pieces and sums them in fp32
  (:func:`~dptrain.compress.sharded.exchange_sum`'s layout); each rank re-encodes its
  summed shard and an all-gather brings every shard to every rank. 2 (M - 1) / M payloads
  sent per rank instead of M - 1; the second encoding's error is not fed back.

The first phase (or the all-gather) is launched at once and runs while the caller computes
(Streaming DiLoCo's overlap); the second, where there is one, runs when the caller waits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dptrain.comm.compat import all_gather_single
from dptrain.comm.topology import shard_bounds
from dptrain.compress.codecs import Codec
from dptrain.compress.feedback import ErrorFeedback
from dptrain.compress.sharded import decode_shards, encode_shards, pack, sum_decoded, unpack

__all__ = ["QuantisedReduction"]


class QuantisedReduction:
    """``codec``'s reduction of a pseudo-gradient over a process group (see the module docstring), with its error
    feedback's residuals, one per key (a Streaming DiLoCo fragment)."""

    def __init__(self, codec: Codec, error_feedback: bool):
        self.codec = codec
        self.feedback = ErrorFeedback() if error_feedback else None

    def launch(self, key: int, delta: torch.Tensor, group: dist.ProcessGroup | None) -> Callable[[], dict[str, int]]:
        """Encode ``delta`` (this rank's pseudo-gradient) and start its reduction; the function returned ends it,
        writes the mean into ``delta`` and returns the bytes (``raw``, ``payload``, ``sent``)."""
        n = dist.get_world_size(group)
        return self._gathered(key, delta, group, n) if n <= 2 else self._exchanged(key, delta, group, n)

    def _gathered(self, key: int, delta: torch.Tensor, group: dist.ProcessGroup | None,
                  n: int) -> Callable[[], dict[str, int]]:
        payload = self.feedback.encode(key, delta, self.codec) if self.feedback is not None else \
            self.codec.encode(delta)
        mine = pack(payload)
        gathered = torch.empty(n * mine.numel(), dtype=torch.uint8, device=mine.device)
        work = all_gather_single(gathered, mine, group=group, async_op=True)

        def done() -> dict[str, int]:
            work.wait()
            sum_decoded(self.codec, [unpack(row, payload) for row in gathered.view(n, -1)], delta,
                        torch.empty_like(delta))
            delta.div_(n)
            return _bytes(delta, payload.nbytes, (n - 1) * payload.nbytes)
        return done

    def _exchanged(self, key: int, delta: torch.Tensor, group: dist.ProcessGroup | None,
                   n: int) -> Callable[[], dict[str, int]]:
        rank = dist.get_rank(group)
        corrected = self.feedback.correct(key, delta) if self.feedback is not None else delta.clone()
        pieces = encode_shards(self.codec, corrected, n)
        if self.feedback is not None:
            self.feedback.keep(key, corrected, decode_shards(self.codec, pieces, torch.empty_like(delta)))
        sizes = [p.nbytes for p in pieces]
        received = torch.empty(n * sizes[rank], dtype=torch.uint8, device=delta.device)
        work = dist.all_to_all_single(received, torch.cat([pack(p) for p in pieces]), [sizes[rank]] * n, sizes,
                                      group=group, async_op=True)
        bounds = shard_bounds(delta.numel(), n)

        def done() -> dict[str, int]:
            work.wait()
            a, b = bounds[rank]
            mine = pieces[rank]
            summed = sum_decoded(self.codec, [unpack(received[j * sizes[rank]:(j + 1) * sizes[rank]], mine)
                                              for j in range(n)], delta[a:b], torch.empty(b - a, device=delta.device))
            again = self.codec.encode(summed.div_(n))
            row = max(sizes)  # a shard's encoding is never larger than the largest first-phase piece
            padded = torch.zeros(row, dtype=torch.uint8, device=delta.device)
            padded[:again.nbytes] = pack(again)
            gathered = torch.empty(n * row, dtype=torch.uint8, device=delta.device)
            all_gather_single(gathered, padded, group=group)
            for j, (lo, hi) in enumerate(bounds):  # an encoding's layout depends on its length only: this rank's
                like = pieces[j]                      # first-phase piece of shard j has the layout of its summed one
                self.codec.decode(unpack(gathered[j * row:j * row + like.nbytes], like), out=delta[lo:hi])
            return _bytes(delta, sum(sizes), sum(sizes) - sizes[rank] + (n - 1) * row)
        return done

    def state_dict(self) -> dict:
        return self.feedback.state_dict() if self.feedback is not None else {"residuals": {}}

    def load_state_dict(self, state: dict) -> None:
        """The residuals this reduction saved; another compressor's (a run resumed with another codec) are not its
        own: it starts from zero, as that compressor does from this one's."""
        if self.feedback is not None and "residuals" in state:
            self.feedback.load_state_dict(state)


def _bytes(delta: torch.Tensor, payload: int, sent: int) -> dict[str, int]:
    return {"raw": delta.numel() * delta.element_size(), "payload": payload, "sent": sent}
