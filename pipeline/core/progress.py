"""Progress bars (tqdm) for the long phases, shown only on a terminal.

A bar is shown when stderr is a terminal, and never otherwise: Snakemake jobs (their
stderr goes to a log file), the benchmark's cases, pipes and tests stay quiet. The
environment variable ``PIPELINE_PROGRESS`` overrides the check: ``1`` (or ``true``,
``yes``, ``on``) always shows bars on stderr, ``0`` (or ``false``, ``no``, ``off``)
never does; unset, empty or ``auto`` means "stderr is a terminal". Any other value is
refused before any work (:mod:`pipeline.config.environment`).

Bars only observe: they never change a result, and they draw at most every
:data:`MININTERVAL` seconds. A phase that ends within :data:`DELAY` seconds draws
nothing at all. Bars are cleared when their phase ends (``leave=False``), so the
terminal keeps only the log lines.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

ENV_VAR = "PIPELINE_PROGRESS"
DELAY = 1.0  # seconds before a bar first appears
MININTERVAL = 0.5  # seconds between two redraws

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
#: Every value of :data:`ENV_VAR` accepted (lower case, stripped).
ACCEPTED = (*_ON, *_OFF, "auto", "")


def enabled(stream: Any = None) -> bool:
    """Whether to show progress bars on ``stream`` (default ``sys.stderr``).

    ``PIPELINE_PROGRESS`` forces the answer (``1``/``0``, see the module docstring);
    otherwise bars are shown only when the stream is a terminal.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def bar(iterable: Iterable | None = None, *, desc: str, total: float | None = None,
        unit: str = "it", delay: float | None = None, leave: bool = False,
        **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, disabled unless :func:`enabled`.

    Use it as a context manager or iterate over it; a disabled bar passes the iterable
    through and ignores ``update``/``set_postfix_str``. ``delay`` defaults to
    :data:`DELAY`; other keyword arguments go to ``tqdm``.
    """
    stream = sys.stderr
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=stream,
                disable=not enabled(stream), leave=leave, mininterval=MININTERVAL,
                delay=DELAY if delay is None else delay, dynamic_ncols=True, **kwargs)


class CallbackBar:
    """A bar opened on its first :meth:`update_to`, for solvers' progress callbacks.

    Nothing is drawn before the first call (a solver may first compile its problem, and
    another bar may be showing meanwhile). Use as a context manager: the bar is closed
    on exit, also when the solver raises. Arguments as for :func:`bar`.
    """

    def __init__(self, desc: str, total: float | None = None, unit: str = "it",
                 delay: float | None = None):
        self.desc, self.total, self.unit, self.delay = desc, total, unit, delay
        self.bar: tqdm | None = None
        self._on = enabled()

    def update_to(self, n: int, postfix: str = "") -> None:
        """Set the count to ``n`` and the postfix text (redrawn at most every
        :data:`MININTERVAL` seconds)."""
        if not self._on:
            return
        if self.bar is None:
            self.bar = bar(total=self.total, desc=self.desc, unit=self.unit, delay=self.delay,
                           initial=n, postfix=postfix or None)
            return
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(n - self.bar.n)

    def close(self) -> None:
        """Close the bar (if one was opened)."""
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> CallbackBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BoundProgress(CallbackBar):
    """``progress(iteration, bound, best_energy)`` callback of TRW-S drawing a bar.

    Iterations out of ``max_iters``; the postfix holds the lower bound, the best energy
    and the relative gap ``(best - bound) / max(1, |best|)`` (µs), the gap of the run
    record. The bar opens at the first iteration (after the solver's compile step).
    """

    def __init__(self, max_iters: int, desc: str = "solve: TRW-S"):
        super().__init__(desc, total=max_iters, unit="it")

    def __call__(self, iteration: int, bound: float, best_energy: float) -> None:
        if not self._on:
            return
        if math.isfinite(best_energy):
            gap = (best_energy - bound) / max(1.0, abs(best_energy))
            text = f"bound={bound:.6g} best={best_energy:.6g} gap={gap:.2g}"
        else:
            text = f"bound={bound:.6g} best=inf"
        self.update_to(iteration, text)
