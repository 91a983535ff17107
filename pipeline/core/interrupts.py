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

__all__ = ["SIGNALS", "Interrupted", "check", "handled"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: The signals received in each active :func:`handled` block, innermost last.
_RECEIVED: list[list[int]] = []


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
    thread); the previous handlers are restored after it.

    A signal is also remembered: Python runs a signal handler at the next bytecode, which
    may be inside code that prints and drops exceptions (an at-fork hook such as
    ``logging``'s lock release while a worker starts, a ``__del__``). A block that ends
    normally after such a lost :class:`Interrupted` still raises it on exit, so the
    signal is honoured (exit 128 + signum) and not turned into whatever failure the lost
    exception left behind."""
    received: list[int] = []
    _RECEIVED.append(received)

    def raise_interrupted(signum: int, frame: Any) -> None:
        received.append(signum)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, raise_interrupted) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _RECEIVED.remove(received)
    if received:  # the block ended normally although a signal arrived: it was swallowed
        raise Interrupted(received[0])


def check() -> None:
    """Raise :class:`Interrupted` if a signal arrived in the innermost :func:`handled`
    block (and was swallowed where it was raised). Called before a result is written,
    so that a run cut short does not record the failure the signal caused as its
    verdict."""
    if _RECEIVED and _RECEIVED[-1]:
        raise Interrupted(_RECEIVED[-1][0])
