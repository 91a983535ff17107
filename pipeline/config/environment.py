"""The ``PIPELINE_*`` environment variables, checked before any work (docs/config.md).

Each variable the pipeline reads is checked here, once, when a config is loaded
(:func:`pipeline.config.load_resolved`) and before logging is set up; a bad value is a
one-line :class:`~pipeline.config.schema.ConfigError` naming the variable, its value
and what is allowed (exit status 2, nothing written):

* ``PIPELINE_LOG_LEVEL``: a :mod:`logging` level name, ``DEBUG``, ``INFO`` (default),
  ``WARNING``, ``ERROR`` or ``CRITICAL`` (any case);
* ``PIPELINE_PROGRESS``: ``1``/``true``/``yes``/``on``, ``0``/``false``/``no``/``off``,
  ``auto`` or empty (:mod:`pipeline.core.progress`);
* ``PIPELINE_ERROR_FD``: a non-negative integer, a file descriptor open for writing
  (set by the Snakemake rules' shell prefix, :mod:`pipeline.stages.runner`);
* ``PIPELINE_SWEEP_OUTCOMES``: an absolute path (set by a sweep for its points,
  :mod:`pipeline.core.sweep`).

Other ``PIPELINE_*`` names (the test suite's ``PIPELINE_TEST_*``) are not the
pipeline's and are left alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pipeline.config.schema import ConfigError
from pipeline.core import progress, sweep

__all__ = ["LOG_LEVELS", "check_environment", "log_level"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_LEVEL_VAR = "PIPELINE_LOG_LEVEL"
ERROR_FD_VAR = "PIPELINE_ERROR_FD"


def _shown(value: str) -> str:
    return value if value.isprintable() and len(value) <= 60 else repr(value[:60])


def log_level(environ: Mapping[str, str] | None = None) -> str:
    """The level name of ``PIPELINE_LOG_LEVEL`` (default ``INFO``).

    Raises:
        ConfigError: not one of :data:`LOG_LEVELS`.
    """
    env = os.environ if environ is None else environ
    value = env.get(LOG_LEVEL_VAR, "INFO")
    level = value.strip().upper() or "INFO"
    if level not in LOG_LEVELS:
        raise ConfigError(f"{LOG_LEVEL_VAR}={_shown(value)}: allowed "
                          + ", ".join(LOG_LEVELS) + " (any case), or unset for INFO")
    return level


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Check every ``PIPELINE_*`` variable the pipeline reads (module docstring).

    Raises:
        ConfigError: one line naming the first bad variable.
    """
    env = os.environ if environ is None else environ
    log_level(env)
    value = env.get(progress.ENV_VAR)
    if value is not None and value.strip().lower() not in progress.ACCEPTED:
        raise ConfigError(f"{progress.ENV_VAR}={_shown(value)}: allowed 1, true, yes, on "
                          "(always show progress bars), 0, false, no, off (never), auto "
                          "or empty (when stderr is a terminal)")
    value = env.get(ERROR_FD_VAR)
    if value is not None and value != "":
        if not (value.isascii() and value.isdigit()):
            raise ConfigError(f"{ERROR_FD_VAR}={_shown(value)}: allowed a non-negative "
                              "integer, a file descriptor open for writing")
        try:
            os.fstat(int(value))
        except OSError as err:
            raise ConfigError(f"{ERROR_FD_VAR}={value}: not an open file descriptor "
                              f"({err.strerror}); allowed one open for writing, or unset"
                              ) from None
    value = env.get(sweep.ENV_VAR)
    if value is not None and not (value and os.path.isabs(value) and "\0" not in value):
        raise ConfigError(f"{sweep.ENV_VAR}={_shown(value)}: allowed an absolute path (a "
                          "sweep sets it for its points), or unset")
