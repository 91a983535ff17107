"""Errors a user can act on, raised by the stages (not by config validation).

The CLIs print the one-line message of a :class:`PlanError` to stderr and exit
with status 2, like a :class:`pipeline.config.ConfigError`.
"""

from __future__ import annotations


class PlanError(ValueError):
    """The placement problem as configured cannot be solved (e.g. contradictory
    constraints). The message is one line naming the config entries involved."""


class WriteError(PlanError):
    """The operating system refused to write an artifact (no space left, a read-only or
    inaccessible directory, a file size limit): one line naming the file, the error and
    its errno name. The artifact is not left half-written (:mod:`pipeline.core.runtime`
    writes to a temporary file and renames it; the temporary file is removed)."""

    @classmethod
    def of(cls, path: object, err: OSError) -> WriteError:
        """The error for ``err`` raised while writing ``path``."""
        import errno as errno_names

        code = err.errno if isinstance(err.errno, int) else None
        name = errno_names.errorcode.get(code, "") if code is not None else ""
        text = err.strerror or (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = f" (errno {code} {name})" if code is not None else ""
        return cls(f"{path}: cannot write it: {text}{where}; nothing half-written was kept "
                   "(free space or fix the permissions, then rerun)")
