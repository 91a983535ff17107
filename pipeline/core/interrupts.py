"""SIGINT and SIGTERM as one exception, for entry points that end with one line.

Within :func:`handled`, either signal raises :class:`Interrupted` in the main thread. It is
a ``BaseException`` (as ``KeyboardInterrupt``), so no ``except Exception`` swallows it, and
it unwinds every ``finally``: a stage cut short removes what it was writing
(:mod:`pipeline.stages.runner`), an exact solve cancels its solver
(:mod:`pipeline.solvers.ilp.highs`). The entry point then prints one line and exits with
the shell's status for the signal, ``128 + signum`` (130 for SIGINT, 143 for SIGTERM).
Used by ``python -m pipeline`` and ``python -m pipeline.verify``
(:mod:`pipeline.verify.signals` adds the stopping of worker processes). Torch-free.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

__all__ = ["SIGNALS", "Interrupted", "handled"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; ``signum`` is which."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal's number."""
        return 128 + self.signum


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise :class:`Interrupted` (in the main
    thread); the previous handlers are restored after it."""

    def raise_interrupted(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, raise_interrupted) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
