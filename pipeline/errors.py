"""The one base class of errors a user can fix (bad config, wrong store, missing file, busy GPU, ...).

Contract: every user-facing error class in dflash subclasses `UserError` (keeping its older built-in base, so
`except ValueError` / `except RuntimeError` callers still work). Its message names the problem and the fix; the
CLI (`stages/cli.py`) prints it as one `error: ...` line and exits 2, with no traceback. `NonFiniteLoss` (training
diverged) is not a usage error: one line and exit 1. Anything else that escapes a stage is a bug and keeps
its traceback.
"""


class UserError(Exception):
    """An error the user can fix; the message says what is wrong and what to do."""


class ConfigError(UserError, ValueError):
    """A configuration problem; the message names the key, the file and the fix (raised by pipeline/config.py and
    its parser, pipeline/config_parse.py)."""


class StoreError(UserError, RuntimeError):
    """A store that cannot be used as asked; the message says what is wrong and what to do (pipeline/store.py and
    its lock raise it; it lives here so the lock needs nothing of the store module)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded as the target; the message names what is missing (pipeline/checkpoint.py
    and its FP8 format, pipeline/fp8_weights.py, raise it; it lives here so that neither imports the other)."""


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN/Inf loss (diverged); the message names the step and what to try."""
