"""pipeline.core.interrupts: a signal is honoured even where its exception was swallowed.

The case CI met: SIGINT to the whole process group arrived while verify forked a worker;
Python ran the handler inside ``logging``'s at-fork hook, which prints and drops the
exception, and verify went on to report the workers' failure (exit 1) instead of the
signal (exit 130).
"""

from __future__ import annotations

import os
import signal

import pytest

from pipeline.core import interrupts
from pipeline.core.interrupts import Interrupted, handled


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_swallowed_signal_is_raised_when_the_block_ends(sig):
    with pytest.raises(Interrupted) as info:
        with handled():
            try:
                os.kill(os.getpid(), sig)
                for _ in range(1000):  # the handler runs at the next bytecode
                    pass
            except Interrupted:
                pass  # what an at-fork hook or a __del__ does with it
    assert info.value.signum == sig
    assert info.value.exit_code == 128 + sig  # 130, 143: the shell's convention


def test_check_raises_inside_the_block_after_a_swallowed_signal():
    with pytest.raises(Interrupted):
        with handled():
            interrupts.check()  # nothing received yet: no-op
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):
                    pass
            except Interrupted:
                pass
            interrupts.check()
            raise AssertionError("check() did not raise")  # pragma: no cover


def test_no_signal_no_exception_and_handlers_restored():
    before = signal.getsignal(signal.SIGINT)
    with handled():
        interrupts.check()
    interrupts.check()  # outside any block: no-op
    assert signal.getsignal(signal.SIGINT) is before


def _dispositions(_chunk: int) -> tuple[bool, bool]:
    return (signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            signal.getsignal(signal.SIGINT) == signal.SIG_IGN)


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(),
                    reason="map_chunks forks")
def test_forked_chunk_workers_do_not_inherit_the_raising_handlers():
    """CI: python -m pipeline's handlers, inherited by a topology worker that the parent
    terminated after it had sent its result, printed an ``Interrupted`` traceback. The
    workers end silently on SIGTERM and leave SIGINT to the parent."""
    from pipeline.core.parallel import map_chunks

    with handled():
        got = map_chunks(_dispositions, [0, 1, 2])
    assert got[1:] == [(True, True), (True, True)]  # the forked children
    assert got[0] == (False, False)  # the calling process keeps its handlers
