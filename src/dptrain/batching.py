"""Batch arithmetic: ``global_batch = micro_batch x world_size x grad_accum_steps``.

The optimizer steps on the *global* batch: every rank runs ``grad_accum_steps``
micro-batches of ``micro_batch_size`` samples, and gradients are averaged over all of
them. Learning-rate rules and published hyperparameters refer to the global batch,
so it is the number to hold fixed when the world size changes. Given any two of global
batch, micro batch and accumulation steps (and the world size), :meth:`BatchPlan.resolve`
derives the third, and refuses combinations that do not multiply out, showing the
arithmetic and the nearest values that would.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchPlan", "BatchSizeError"]


class BatchSizeError(ValueError):
    """Batch sizes that do not satisfy global = micro x world x accum."""


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    world_size: int

    @property
    def samples_per_micro_step(self) -> int:
        """Samples all ranks process together in one micro-step."""
        return self.micro_batch_size * self.world_size

    @classmethod
    def resolve(
        cls,
        world_size: int,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        grad_accum_steps: int | None = None,
        section: str = "",
    ) -> BatchPlan:
        """Complete and check a batch plan from any two of the three sizes.

        With only ``global_batch_size`` or only ``micro_batch_size``, accumulation is 1. An error suggests the values
        that would multiply out by their argument names, or, with ``section`` (``"train"``), as the config keys and the
        ``--set`` that sets them.
        """
        _check_positive(world_size=world_size, global_batch_size=global_batch_size,
                        micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps)
        g, m, a, w = global_batch_size, micro_batch_size, grad_accum_steps, world_size
        if g is None and m is None:
            raise BatchSizeError("give global_batch_size or micro_batch_size (with grad_accum_steps "
                                 "the other is derived)")
        if g is None:
            a = 1 if a is None else a
            return cls(m * w * a, m, a, w)
        if m is None:
            a = 1 if a is None else a
            if g % (a * w):
                raise BatchSizeError(
                    f"global batch {g} is not divisible by accum {a} x world {w} = {a * w}, so "
                    f"the micro batch would not be whole; {_fixes([_global(g, a * w)], section)}")
            return cls(g, g // (a * w), a, w)
        if a is None:
            if g % (m * w):
                micro = [("micro_batch_size", _divisors_near(g // w, m))] if g % w == 0 else []
                raise BatchSizeError(
                    f"global batch {g} is not a multiple of micro {m} x world {w} = {m * w}, so "
                    f"grad_accum_steps would not be whole; {_fixes([_global(g, m * w), *micro], section)}")
            return cls(g, m, g // (m * w), w)
        if g != m * a * w:
            options = ([("micro_batch_size", str(g // (a * w)))] if g % (a * w) == 0 else []) + \
                [("global_batch_size", str(m * a * w))] + \
                ([("grad_accum_steps", str(g // (m * w)))] if g % (m * w) == 0 else [])
            raise BatchSizeError(
                f"global batch {g} != micro {m} x accum {a} x world {w} = {m * a * w}; {_fixes(options, section)}")
        return cls(g, m, a, w)


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise BatchSizeError(f"{name} must be a positive integer, got {value!r}")


def _global(g: int, step: int) -> tuple[str, str]:
    return "global_batch_size", _nearest_multiples(g, step)


def _fixes(options: list[tuple[str, str]], section: str) -> str:
    """``choose global_batch_size 30 or 33``; with a section, the config key and a ``--set`` for the first value."""
    if not section:
        return "choose " + ", or ".join(f"{name} {values}" for name, values in options)
    return "set " + ", or ".join(f"{section}.{name} to {values} (--set {section}.{name}={values.split()[0]})"
                                 for name, values in options)


def _nearest_multiples(value: int, step: int) -> str:
    below = (value // step) * step
    above = below + step
    return f"{below} or {above}" if below > 0 else f"{above}"


def _divisors_near(value: int, near: int) -> str:
    divisors = [d for d in range(1, value + 1) if value % d == 0]
    below = [d for d in divisors if d < near]
    above = [d for d in divisors if d > near]
    picks = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " or ".join(str(d) for d in picks)
