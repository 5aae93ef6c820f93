"""The machinery of the settings: the `Settings` base model, `setting()` (a field with its --help
group and the older names it also accepts), and the helpers that let code below the configs use
their defaults (`default_of`) or offer the same setting (`same_as`)."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field


# The order of the groups of settings, in --help and in the files `swarm config ROLE` prints
GROUP_ORDER = ("swarm", "task", "loss", "optimizer", "lora", "training", "generation", "device", "sampler", "vllm", "staleness",
               "evaluation", "output", "other")


def setting(default: Any = ..., *, group: str, help: str = "", aliases: tuple[str, ...] = (), **bounds) -> Any:
    """A field with its option group (for --help) and old names it also accepts."""
    extra = {"group": group}
    if aliases:
        extra["aliases"] = list(aliases)
    kwargs: dict[str, Any] = dict(description=help, json_schema_extra=extra, **bounds)
    if callable(default):  # list, LossConfig: a fresh value per instance
        kwargs["default_factory"] = default
    else:
        kwargs["default"] = default
    return Field(**kwargs)


def aliased(model: type[BaseModel]) -> type[BaseModel]:
    """Let each field also be set under its aliases (file keys and keyword arguments)."""
    for name, field in model.model_fields.items():
        aliases = (field.json_schema_extra or {}).get("aliases") if isinstance(field.json_schema_extra, dict) else None
        if aliases and field.validation_alias is None:
            field.validation_alias = AliasChoices(name, *aliases)
    model.model_rebuild(force=True)
    return model


def default_of(model: type[BaseModel], name: str) -> Any:
    """The default of `model`'s field `name`: for code below the configs that needs the same default."""
    return model.model_fields[name].get_default(call_default_factory=True)


def same_as(model: type[BaseModel], name: str, *, group: str | None = None, help: str | None = None) -> Any:
    """The field `name` of `model`, for a config that offers the same setting with the same default
    (in another --help group, or described for its role, when given)."""
    field = copy.copy(model.model_fields[name])
    if group is not None:
        field.json_schema_extra = {**(field.json_schema_extra or {}), "group": group}
    if help is not None:
        field.description = help
    return field


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def field_names_of(model: type[BaseModel], name: str) -> list[str]:
    """A field's name and its aliases."""
    extra = model.model_fields[name].json_schema_extra
    return [name, *(extra.get("aliases", ()) if isinstance(extra, dict) else ())]


def field_names(model: type[BaseModel]) -> set[str]:
    """Every key a config file may use for `model`: field names and their aliases."""
    return {key for name in model.model_fields for key in field_names_of(model, name)}
