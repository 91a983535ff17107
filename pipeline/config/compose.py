"""Composing a config from Hydra overrides with the compose API (:func:`load_config`,
:func:`load_resolved`), and turning Hydra's multi-line composition errors into one line.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from omegaconf import DictConfig

from pipeline.config.environment import check_environment
from pipeline.config.overrides import check_overrides, normalise_overrides
from pipeline.config.schema import (
    CONF_DIR,
    SCHEMAS,
    ConfigError,
    allowed_text,
    group_options,
    register_configs,
)
from pipeline.config.validate import resolve


def _composition_error(err: Exception, overrides: Sequence[str]) -> ConfigError:
    """Turn a (multi-line) Hydra/OmegaConf composition error into one line."""
    text = str(err)
    m = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if m:
        group, choice = m.group(1), m.group(2)
        options = group_options(group)
        if group.startswith("model/"):  # a preset of a model family: model=hf/<preset>
            sub = group.split("/", 1)[1]
            group, choice, options = "model", f"{sub}/{choice}", [f"{sub}/{o}" for o in options]
        allowed = ", ".join(options) if options else "none (the group has no options)"
        return ConfigError(f"{group}={choice}: allowed {allowed}")
    m = re.search(r"(?:Could not override|Error merging override) '?([^'=\s]+)", text)
    key = m.group(1).lstrip("+~") if m else getattr(err, "full_key", None)
    shown = next((ov for ov in overrides if key and ov.split("=", 1)[0].lstrip("+~") == key),
                 key)
    cause = err.__cause__ or err
    ctext = str(cause)
    unknown = re.search(r"Key '([^']+)' (?:is )?not in '(\w+)'", ctext)
    if unknown and unknown.group(2) in SCHEMAS:
        keys = ", ".join(f.name for f in dataclasses.fields(SCHEMAS[unknown.group(2)]))
        return ConfigError(f"{shown}: unknown key '{unknown.group(1)}'; allowed keys: {keys}")
    full_key = re.sub(r"\[(\d+)\]", r".\1", str(getattr(cause, "full_key", "") or ""))
    first = ctext.strip().splitlines()[0] if ctext.strip() else type(err).__name__
    if shown and m and full_key and full_key != key:
        hint = ("; to add list entries set the whole list, e.g. "
                "constraints.nodes=[{match:x,placement:'RRR'}]"
                if re.search(r"\.\d+(\.|$)", key or "") else "")
        return ConfigError(f"{shown}: {first} (at {full_key}){hint}")
    if shown and m:
        return ConfigError(f"{shown}: {allowed_text(str(key))}")
    if full_key:
        return ConfigError(f"{full_key}: {first} (value from a config file); "
                           f"{allowed_text(str(full_key))}")
    return ConfigError(first)


def load_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides (compose API), unresolved.

    Args:
        overrides: Hydra overrides, e.g. ``["model=toy", "mesh=2x4x8",
            "solver.time_limit_s=60"]``; ``mesh=2,4,8`` is accepted (see
            :func:`normalise_overrides`).

    Returns:
        The composed config in struct mode (no ``hydra`` node). Pass it through
        :func:`resolve` before use.

    Raises:
        ConfigError: one line, for an unknown group option (``solver=foo``), an unknown
            key, a value of the wrong type (``lazy_costs=maybe``) or a malformed override.
        FileNotFoundError: ``conf/`` is missing (a non-editable install).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not (CONF_DIR / "config.yaml").is_file():
        raise FileNotFoundError(f"{CONF_DIR / 'config.yaml'} not found: the pipeline runs from "
                                "a checkout (install it with `pip install -e .`)")
    overrides = normalise_overrides(list(overrides))
    check_overrides(overrides)
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        raise _composition_error(err, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def load_resolved(overrides: Sequence[str] = ()) -> DictConfig:
    """``resolve(load_config(overrides))`` after :func:`check_environment`; raises
    :class:`ConfigError` on any bad value (of an override or a ``PIPELINE_*`` variable)."""
    check_environment()
    return resolve(load_config(overrides))
