"""User-facing errors.

A ``UserError`` is a mistake in what the user gave us (a config key, a file, a
layout), not a bug in rlsys. The CLI prints its message on one line and exits
with code 2 instead of showing a traceback.
"""


class UserError(Exception):
    """Bad input from the user; the message names the problem and the fix."""

    exit_code = 2


class ConfigError(UserError):
    """An invalid experiment config: names the key path, the value and the rule."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"config error at '{path}': {message}" if path else f"config error: {message}")


class CheckpointError(UserError):
    """A missing, unsupported or corrupt checkpoint."""


class TrainingDiverged(UserError):
    """Too many consecutive steps whose updates were skipped for non-finite gradients."""

    exit_code = 3
