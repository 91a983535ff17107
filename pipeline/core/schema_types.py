"""The type of a dotted key in a dataclass schema (used by the config layer and the model
families to type-check overrides before Hydra composes them)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any


def field_type(root: Any, parts: Sequence[str]) -> tuple[Any, bool] | None:
    """(type, optional) of the key ``parts`` below the dataclass ``root``, ``None`` if the
    schema has no such key. List indices (``nodes.0.match``) and dict entries are
    followed; below an ``Any`` field everything is ``(Any, True)``; ``Optional[T]``
    gives ``(T, True)``."""
    t: Any = root
    optional = False
    for part in parts:
        origin = typing.get_origin(t)
        if dataclasses.is_dataclass(t):
            hints = typing.get_type_hints(t)
            if part not in hints:
                return None
            t = hints[part]
        elif origin is list and part.isdigit():
            t = typing.get_args(t)[0]
        elif origin is dict:
            t = typing.get_args(t)[1]
        elif t is Any:
            return Any, True
        else:
            return None
        args = typing.get_args(t)
        optional = type(None) in args
        if optional:
            rest = [a for a in args if a is not type(None)]
            t = rest[0] if len(rest) == 1 else Any
    return t, optional
