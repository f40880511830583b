"""The project's errors. Each ends a run with one line (`jaxrl: error: ...`) rather than a traceback.

A `ConfigError` is a mistake in what the user asked for (exit code 2): a field, a file, a checkpoint
they pointed at. A `RunError` is a run that cannot go on although the request was sound (exit code 1).
This module imports nothing, so the command line can catch these without importing JAX.
"""


class ConfigError(ValueError):
    """A user mistake in a config file, an override or a named input; one line naming the field or file."""


class RunError(RuntimeError):
    """A run that cannot go on; the message is one line naming the step, file or directory."""


class CheckpointError(ConfigError):
    """A checkpoint (a run's step directory, a safetensors file, a tensor in it) is missing, malformed or
    does not fit the model; the message names which."""


class WorkdirError(ConfigError):
    """`--workdir` cannot be used as given; one line naming the directory and why."""


class NonFiniteError(RunError):
    """The run produced non-finite values; it stops rather than save them. One line naming the step."""


def first_line(e: BaseException) -> str:
    """The root cause's type and first line: orbax wraps tensorstore's one-line reason in a page of spec."""
    while (cause := e.__cause__ or e.__context__) is not None:
        e = cause
    line = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {line[:300]}"
