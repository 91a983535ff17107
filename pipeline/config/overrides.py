"""Hydra override syntax: rendering values as override text, normalising the spellings
Hydra's grammar would refuse or misread, checking overrides before composing, and
expanding a multirun's sweep overrides into jobs."""

from __future__ import annotations

import itertools
import re
import typing
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.config.schema import (
    GROUPS,
    ConfigError,
    allowed_text,
    group_options,
    known_keys,
    schema_type,
)

# --------------------------------------------------------------------------- rendering


def _fmt(value: Any) -> str:
    """Render a value the way a user writes it in an override (``[2,4]``, ``null``)."""
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_fmt(v)}" for k, v in value.items()) + "}"
    return str(value)


_BARE_STR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HYDRA_WORDS = frozenset({"true", "false", "null", "inf", "nan"})


def _hydra_value(value: Any) -> str:
    """Render plain data in Hydra's override grammar; a string is single-quoted unless it
    is a plain identifier Hydra reads back as the same string."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        if _BARE_STR_RE.match(value) and value.lower() not in _HYDRA_WORDS:
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {type(value).__name__} as a Hydra override")

# ------------------------------------------------------------------ normalising and checking


_COMMA_LIST_RE = re.compile(r"^(?P<key>mesh|mesh_names)=(?P<val>[^'\"\[\]{}()]*,[^'\"\[\]{}()]*)$")
_PLACEMENT_KEY_RE = re.compile(
    r"^(?P<key>constraints\.(?:inputs|outputs|nodes\.\d+\.placement))=(?P<val>[^'\"\[\]{}]*)$")


def normalise_overrides(overrides: Sequence[str], multirun: bool = False) -> list[str]:
    """Accept spellings Hydra's grammar would refuse or misread, without changing meaning.

    * ``mesh=2,4,8`` / ``mesh_names=a,b`` outside a sweep: Hydra reads an unquoted comma
      list as a sweep and refuses it in a single run, where it can only mean one value;
      it becomes ``mesh='2,4,8'`` / ``mesh_names=[a,b]``. In a multirun
      (``multirun=True``) a comma list stays a sweep.
    * a placement with parentheses, ``constraints.inputs=S(0)RR``, is quoted.
    * ``experiment=null`` (no experiment) becomes ``~experiment``, which Hydra accepts.
    * a mapping for a dict-typed key, ``model.ffn_hidden_overrides={0:4096}``, becomes
      ``++model.ffn_hidden_overrides={0:4096}``: a plain override of a dict merges in
      struct mode and refuses new keys; ``++`` merges them in.
    """
    out = []
    for ov in overrides:
        m = _COMMA_LIST_RE.match(ov)
        if m and not multirun:
            if m["key"] == "mesh":
                ov = f"mesh='{m['val']}'"
            else:
                ov = "mesh_names=[" + ",".join(p.strip() for p in m["val"].split(",")) + "]"
        m = _PLACEMENT_KEY_RE.match(ov)
        if m and re.search(r"[()|]", m["val"]):
            ov = f"{m['key']}='{m['val']}'"
        key, sep, val = ov.partition("=")
        if key == "experiment" and val == "null":
            ov = "~experiment"
        if sep and val.startswith("{") and re.fullmatch(r"[\w.]+", key):
            found = schema_type(key)
            if found is not None and typing.get_origin(found[0]) is dict:
                ov = "++" + ov
        out.append(ov)
    return out


def check_overrides(overrides: list[str]) -> None:
    """Check each override before composing, for errors Hydra reports badly or not at all.

    Raises:
        ConfigError: an override Hydra cannot parse, a sweep in a single run, an unknown
            key, a deletion of a schema key, or a bool key set to anything but true/false.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for ov in overrides:
        try:
            parsed = parser.parse_override(ov)
        except HydraException as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else "syntax error"
            raise ConfigError(
                f"{ov}: not a valid override ({reason}); write key=value and quote a value "
                "holding ( ) , | or spaces, e.g. \"constraints.inputs='S(0)RR'\"") from None
        key = parsed.key_or_group
        if key.startswith("hydra") or "/" in key:
            continue
        if parsed.is_sweep_override():
            raise ConfigError(f"{ov}: a list of values is a sweep; run with -m to sweep, or "
                              "quote the value")
        if key in GROUPS:
            if parsed.value() is None and not parsed.is_delete():
                raise ConfigError(f"{ov}: allowed " + ", ".join(group_options(key)))
            continue
        found = schema_type(key)
        if found is None:
            raise ConfigError(f"{ov}: unknown key; {known_keys(key)}")
        if parsed.is_delete():
            raise ConfigError(f"{ov}: schema keys cannot be deleted; set the key instead")
        t, optional = found
        value = parsed.value()
        if t is bool and not (isinstance(value, bool) or (optional and value is None)):
            raise ConfigError(f"{ov}: {allowed_text(key)}")

# --------------------------------------------------------------------------- sweeps


def sweep_overrides(overrides: Sequence[str]) -> list[list[str]]:
    """Expand a multirun's sweep overrides (``mesh=8,2x4``) into one override list per job,
    as Hydra's basic sweeper does.

    Raises:
        ConfigError: one line for an override Hydra cannot parse.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as err:
        raise ConfigError(str(err).strip().splitlines()[0]) from None
    choices = []
    for ov, text in zip(parsed, overrides, strict=True):
        if ov.is_sweep_override():
            key = ov.get_key_element()
            choices.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        else:
            choices.append([text])
    return [list(job) for job in itertools.product(*choices)]
