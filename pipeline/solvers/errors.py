"""Exceptions raised by the solvers."""

from __future__ import annotations


class InfeasibleError(ValueError):
    """No labelling satisfies the forbidden entries and side constraints."""


class FractionalRelaxationError(RuntimeError):
    """``relax=True`` was asked but the LP optimum is fractional."""
