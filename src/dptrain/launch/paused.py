"""Imported first by a fork server (:mod:`dptrain.launch.workers`): the garbage collector pauses while the server
preloads, and :mod:`dptrain.launch.frozen`, imported last, freezes what it made and starts the collector again.

The preload makes about 300,000 tracked objects that live for the server's life; each full collection during the
imports walked all those made so far: 2.1-2.5 s of CPU paused, 2.4-2.9 s not (:mod:`dptrain.utils.collector`).
"""

from __future__ import annotations

import gc

gc.disable()
