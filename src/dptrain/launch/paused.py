"""Imported first by a fork server (:mod:`dptrain.launch.workers`): the garbage collector pauses while the server
preloads, and :mod:`dptrain.launch.frozen`, imported last, freezes what it made and starts the collector again.

The preload makes about 500,000 tracked objects that live for the server's life; each full collection during the
imports walked all those made so far: median 2.38 s of CPU paused, 3.14 s not (:mod:`dptrain.utils.collector`).
"""

from __future__ import annotations

import gc

gc.disable()
