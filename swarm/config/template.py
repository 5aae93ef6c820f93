"""A role's default config file, written from its pydantic model: every field with its description
as a comment and its default as the value (`swarm config ROLE` prints it). Generated, so it cannot
drift from the models; it reads back as the same defaults (tests/cli/test_newcomer.py).

TOML has no null: a setting whose default is unset is written commented out, and so is a setting
the role must be given (the learner's `peers`, the sampler's `learner_keys`): uncomment and fill in."""

from __future__ import annotations

import json
import textwrap
from typing import Any

from pydantic import BaseModel

from swarm.config.base import GROUP_ORDER
from swarm.config.roles import CONFIGS, REAL_MODEL_COMPLETION_LENGTH

# Settings with no usable default: each role must be given these (the config refuses to load without).
REQUIRED = {"learner": ("peers",), "sampler": ("peers", "learner_keys")}
EXAMPLES = {"peers": '["/ip4/10.0.0.1/tcp/31337/p2p/Qm..."]  # or ["HOST:PORT"] with transport = "grpc"',
            "learner_keys": '["THE-KEY-A-LEARNER-PRINTS"]'}
# Settings whose default depends on another (written out, it would stop depending): shown commented out.
DEPENDENT = {"max_completion_length": f"for the embedded policy; {REAL_MODEL_COMPLETION_LENGTH} for any other model"}
WIDTH = 100


def toml_value(value: Any) -> str:
    """A default as TOML: strings JSON-quoted (TOML's basic strings take JSON's escapes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def _comment(text: str, indent: str = "") -> list[str]:
    return [f"{indent}# {line}" for line in textwrap.wrap(text, WIDTH - len(indent) - 2)] if text else []


def _fields(model: type[BaseModel], required: tuple[str, ...]) -> tuple[list[str], list[tuple[str, type[BaseModel]]]]:
    """The lines of `model`'s plain fields, in --help groups, and its nested models (written as tables)."""
    lines: list[str] = []
    nested: list[tuple[str, type[BaseModel]]] = []
    group = None
    def rank(item):
        extra = item[1].json_schema_extra if isinstance(item[1].json_schema_extra, dict) else {}
        group = extra.get("group", "other")
        return GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER)

    for name, field in sorted(model.model_fields.items(), key=rank):  # sorted() is stable: fields keep their order
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            nested.append((name, field.annotation))
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("group") != group:
            group = extra.get("group")
            lines += ["", f"# --- {group} ---"]
        lines += _comment(field.description or "")
        default = field.get_default(call_default_factory=True)
        if name in required:
            lines.append(f"# {name} = {EXAMPLES.get(name, '...')}  # required: uncomment and fill in")
        elif name in DEPENDENT and "model" in model.model_fields:
            lines.append(f"# {name} = {toml_value(default)}  # default: {toml_value(default)} {DEPENDENT[name]}")
        elif default is None:
            lines.append(f"# {name} =  # unset by default")
        else:
            lines.append(f"{name} = {toml_value(default)}")
    return lines, nested


def default_config_text(role: str) -> str:
    """The commented TOML config file of `role`'s defaults, in the role's own table."""
    if role not in CONFIGS:
        raise ValueError(f"unknown role {role!r}; choose one of: {', '.join(CONFIGS)}")
    model = CONFIGS[role]
    lines = [f"# The default settings of `swarm {role}`, generated from its config (swarm/config/).",
             *_comment(" ".join((model.__doc__ or "").split("\n\n")[0].split())),
             f"# Use it with `swarm {role} --config FILE`; options on the command line take precedence.",
             f"# Settings shared by several roles may also go at the top level, above the [{role}] table.",
             "", f"[{role}]"]
    body, nested = _fields(model, REQUIRED.get(role, ()))
    lines += body
    for name, sub in nested:
        sub_lines, _ = _fields(sub, ())
        lines += ["", f"[{role}.{name}]", *_comment(model.model_fields[name].description or ""), *sub_lines]
    return "\n".join(lines) + "\n"
