"""Errors that end a run with one line (`jaxrl: error: ...`, exit code 1) rather than a traceback.

`jaxrl.config.ConfigError` is a mistake in what the user asked for (exit code 2); a `RunError` is a run
that cannot go on although the request was sound: no checkpoint restores, the loss went NaN. This
module imports nothing heavy, so the command line can catch these without importing JAX.
"""


class RunError(RuntimeError):
    """A run that cannot go on; the message is one line naming the step, file or directory."""
