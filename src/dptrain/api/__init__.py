"""The user API: :class:`~dptrain.api.engine.Engine` for a loop you write around it, and
:func:`~dptrain.api.prepare.prepare` for an ordinary loop made data-parallel (Accelerate's way).

Both wrap a model with a strategy from :mod:`dptrain.strategies` and take their optimizer
step through one core (:mod:`~dptrain.api.step`).
"""
