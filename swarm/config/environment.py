"""Settings from `GEPO_SWARM_*` environment variables: `GEPO_SWARM_LEARNING_RATE=1e-5` sets
`learning_rate`, `GEPO_SWARM_LOSS__BETA=0.01` the loss's `beta` (a double underscore steps into a
table). Precedence: command line > environment > config file > defaults (files.resolve).

A variable sets the setting in every role that has it and is ignored by the others (one shell may
start a learner and a sampler). A name close to a setting's that no role has is a typo, and an
error; other `GEPO_SWARM_*` names (GEPO_SWARM_CACHE, ...) are not settings and are left alone.
Lists are JSON (`GEPO_SWARM_PEERS='["/ip4/..."]'`) or one bare value; pydantic parses the rest."""

from __future__ import annotations

import json
from typing import Any, Mapping

from pydantic import BaseModel

from swarm.config.base import field_names, field_names_of
from swarm.config.hints import close_names
from swarm.config.roles import CONFIGS

PREFIX = "GEPO_SWARM_"
NESTED = "__"


def setting_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The `GEPO_SWARM_*` variables, by lower-case setting name ("loss__beta")."""
    return {key[len(PREFIX):].lower(): value for key, value in environ.items() if key.startswith(PREFIX)}


def _every_name() -> set[str]:
    names = set()
    for model in CONFIGS.values():
        names |= field_names(model)
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                names |= {f"{name}{NESTED}{sub}" for sub in field_names(field.annotation)}
    return names


def _value(model: type[BaseModel], name: str, text: str) -> Any:
    """A variable's text as the field wants it: lists from JSON or as one item."""
    annotation = model.model_fields[name].annotation
    if getattr(annotation, "__origin__", None) is list:
        if text.strip().startswith("["):
            try:
                return json.loads(text)
            except ValueError as exc:
                raise ValueError(f"{PREFIX}{name.upper()}: not a JSON list ({exc}); write e.g. '[\"a\", \"b\"]'") from None
        return [text]
    return text


def environment_values(role: str, environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings `role` takes from `environ`, under their field names (nested tables as dicts)."""
    model = CONFIGS[role]
    known = _every_name()
    values: dict[str, Any] = {}
    for key, text in sorted(setting_variables(environ).items()):
        head, _, sub = key.partition(NESTED)
        if key not in known:
            close = close_names(key, known)
            if close:
                raise ValueError(f"environment variable {PREFIX}{key.upper()} is not a setting (did you mean "
                                 f"{' or '.join(PREFIX + c.upper() for c in close)}?)")
            continue  # not a setting: another use of the prefix
        name = next((n for n in model.model_fields if head in field_names_of(model, n)), None)
        if name is None:
            continue  # another role's setting
        if sub:
            nested = model.model_fields[name].annotation
            sub_name = next(n for n in nested.model_fields if sub in field_names_of(nested, n))
            values.setdefault(name, {})[sub_name] = _value(nested, sub_name, text)
        else:
            values[name] = _value(model, name, text)
    return values


def without_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less the variables that are settings (GEPO_SWARM_CACHE and the like stay)."""
    known = _every_name()
    return {k: v for k, v in environ.items() if not (k.startswith(PREFIX) and k[len(PREFIX):].lower() in known)}
