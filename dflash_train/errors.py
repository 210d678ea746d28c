"""Errors the framework raises for user-fixable problems (bad config, bad target, bad data)."""


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix in one line."""
