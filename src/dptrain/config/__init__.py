"""A run's configuration: the schema (dataclasses) and its strict TOML loader."""

from dptrain.config.loader import ConfigError, identity, identity_hash, load_config, to_toml
from dptrain.config.schema import RunConfig

__all__ = ["RunConfig", "ConfigError", "load_config", "to_toml", "identity", "identity_hash"]
