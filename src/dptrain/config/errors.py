"""The one error a bad configuration raises (``dptrain run`` prints its message and exits 2)."""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config that cannot be run as written; the message says why and how to fix it."""
