"""Errors the framework raises for user-fixable problems (bad config, bad target, bad data)."""


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix in one line."""


class MissingDependencyError(ImportError):
    """A package the requested work needs is not installed; the message gives the install line."""


class InputFileError(ValueError):
    """An input file or directory is missing, empty, truncated or of the wrong kind; the message names it and the fix."""


class NonFiniteTrainingError(RuntimeError):
    """Training produced NaN or infinite gradients too many steps in a row; the message names the limit and the fix."""
