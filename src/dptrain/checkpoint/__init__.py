"""Checkpoints, in one package: complete or absent, checked before they are trusted, readable by any strategy.

- :mod:`~dptrain.checkpoint.files`: the directory of one checkpoint, written beside and published
  with one rename, verified by checksums, found by content, rotated; RNG states;
- the layouts, one module each: :mod:`~dptrain.checkpoint.replicated` state (model.pt and
  optimizer.pt: every rank holds it, rank 0 writes it), :mod:`~dptrain.checkpoint.sharded`
  (DCP files every rank writes its part of; its metadata read by
  :mod:`~dptrain.checkpoint.safe_metadata`, never with plain pickle), :mod:`~dptrain.checkpoint.ps`
  (the parameter server's format);
- :mod:`~dptrain.checkpoint.state`: a checkpoint of one layout loaded by a wrapper of another;
- :mod:`~dptrain.checkpoint.save` and :mod:`~dptrain.checkpoint.resume`: a run's checkpoint taken
  and picked up, the strategy's own state through its wrapper (the strategies' protocol);
- :mod:`~dptrain.checkpoint.consolidate`: one safetensors file from any checkpoint, in one process.

Nothing here knows a strategy: what differs between them reaches this package through the
wrapper's members and the registry's ``checkpoint_layout``. The package sits below the
strategies' own packages, which write their shards with the format it defines.
"""
