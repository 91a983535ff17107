"""Errors a user can act on, raised by the stages (not by config validation).

The CLIs print the one-line message of a :class:`PlanError` to stderr and exit
with status 2, like a :class:`pipeline.config.ConfigError`.
"""


class PlanError(ValueError):
    """The placement problem as configured cannot be solved (e.g. contradictory
    constraints). The message is one line naming the config entries involved."""
