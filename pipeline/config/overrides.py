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

from pipeline import models as model_families
from pipeline.config.schema import (
    GROUPS,
    ConfigError,
    allowed_text,
    group_options,
    known_keys,
    schema_type,
)

# --------------------------------------------------------------------------- rendering

#: How :func:`override_value` writes a string, see there.
QUOTE_MODES: tuple[str, ...] = ("auto", "path", "always", "never")

_IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH_RE = re.compile(r"[A-Za-z0-9_./+-]+")
_HYDRA_WORDS = frozenset({"true", "false", "null", "inf", "nan"})
#: A run of backslashes before a quote or the end: the only place Hydra reads ``\\``
#: as an escape in a quoted value (elsewhere a backslash is literal).
_ESCAPE_RE = re.compile(r"(\\*)('|$)")


def override_value(value: Any, quote: str = "auto") -> str:
    """Render a value as Hydra override text, the ``<value>`` of ``key=<value>``.

    ``None`` is ``null``, a bool ``true``/``false``, a number as Python writes it, a list
    ``[a,b]`` and a mapping ``{k:v}`` (OmegaConf containers as their plain data), their
    items rendered the same way. A string is written according to ``quote``:

    * ``"auto"``: bare when Hydra reads it back as the same string (an identifier that
      is not one of true, false, null, inf, nan in any case), else single-quoted
      (``'2x4'``, ``'/tmp/a b'``, ``'S(0)RR'``): a quote is escaped as ``\\'`` and the
      backslashes before a quote or the end are doubled, as Hydra's grammar reads them;
    * ``"path"``: bare when it consists of letters, digits and ``_ . / + -`` and is not
      one of those words (``results_dir=/tmp/results``), else quoted as above;
    * ``"always"``: quoted as above;
    * ``"never"``: as it is, the way a one-line message shows a value
      (``mesh=2,0,8: allowed ...``); a value of any other type is written with ``str``.

    Raises:
        ValueError: ``quote`` is not one of :data:`QUOTE_MODES`.
        TypeError: a value of another type (a set, an object) unless ``quote="never"``.
    """
    if quote not in QUOTE_MODES:
        raise ValueError(f"quote={quote}: allowed {', '.join(QUOTE_MODES)}")
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        bare = {"auto": _IDENTIFIER_RE, "path": _PATH_RE}.get(quote)
        if quote == "never" or (bare is not None and bare.fullmatch(value)
                                and value.lower() not in _HYDRA_WORDS):
            return value
        return "'" + _ESCAPE_RE.sub(lambda m: 2 * m[1] + ("\\'" if m[2] else ""), value) + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v, quote) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v, quote)}" for k, v in value.items()) + "}"
    if quote == "never":
        return str(value)
    raise TypeError(f"cannot render {type(value).__name__} as a Hydra override")


def printable(text: str) -> str:
    """``text`` with every non-printable character (``str.isprintable``: line breaks,
    tabs, other controls) written as its Python escape (``\\n``, ``\\t``, ``\\x00``)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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
        # An entry of a free-form model mapping (model.config.n_layer=4, a builder kwarg)
        # may be absent from the preset: add-or-override.
        elif sep and any(key.startswith(k + ".") for k in model_families.OPEN_MAPPING_KEYS):
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
                f"{printable(ov)}: not a valid override ({printable(reason)}); write "
                "key=value and single-quote a value holding other characters than letters, "
                "digits and _ . / + - (spaces, ( ) , | ; $ quotes, non-ASCII), e.g. "
                "\"constraints.inputs='S(0)RR'\" or \"results_dir='my results'\"") from None
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
