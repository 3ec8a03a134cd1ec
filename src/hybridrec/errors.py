"""Errors that reach the user as one clear line (no traceback)."""


class HybridrecError(Exception):
    """Base class: bad input, config or data. The message says what and where."""


class ConfigError(HybridrecError):
    """An unknown config key or a bad value; the message names the key."""


class DataError(HybridrecError):
    """Malformed or missing input data; the message names file, line and field."""
