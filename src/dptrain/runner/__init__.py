"""The job runner: what ``dptrain run`` executes on every rank (``python -m dptrain.run``).

Validation before launch (:mod:`~dptrain.runner.validate`), the training loop
(:mod:`~dptrain.runner.loop`) with its step hooks (metrics, traces, checkpoints,
evaluation, fault and straggler injection, divergence checks), checkpoints, and the
parameter server's own loop. It sits above the user API (``dptrain.api``), which it
drives, and below the pages and the CLI, which read the run directory it writes.
"""
