"""Command-line options generated from the peer configuration models (swarm/config.py), and the
step that merges them with a config file. Only options the user actually gave override the file:
click's defaults are left as None and the model's own defaults apply."""

from __future__ import annotations

import typing
from pathlib import Path

import click

# option names kept short or singular where the field name reads badly on a command line
OPTION_NAMES = {"learner_keys": "--learner-key", "max_age_s": "--max-age"}


def option_name(field: str) -> str:
    return OPTION_NAMES.get(field, "--" + field.replace("_", "-"))


def _click_type(annotation):
    """(click type, multiple) for a field annotation: T, Optional[T] or list[T]."""
    if typing.get_origin(annotation) is list:
        return _click_type(typing.get_args(annotation)[0])[0], True
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    if typing.get_origin(base) is list:
        return _click_type(typing.get_args(base)[0]), True
    return {int: click.INT, float: click.FLOAT, str: click.STRING, Path: click.Path(), bool: bool}.get(base, click.STRING), False


def config_options(role: str):
    """Decorator: one click option per field of the role's config model, plus --config."""
    from swarm.config import CONFIGS

    model = CONFIGS[role]

    def decorate(func):
        for name, field in reversed(list(model.model_fields.items())):
            kind, multiple = _click_type(field.annotation)
            default = field.get_default(call_default_factory=True)
            shown = "" if default in (None, []) else f" (default: {default})"
            help_text = (field.description or "") + shown
            if kind is bool:
                func = click.option(f"{option_name(name)}/--no-{name.replace('_', '-')}", name, default=None, help=help_text)(func)
            else:
                func = click.option(option_name(name), name, type=kind, multiple=multiple, default=None, help=help_text)(func)
        return click.option("--config", "config_file", type=click.Path(dir_okay=False),
                            help="TOML, YAML or JSON file with settings; options given here take precedence")(func)

    return decorate


def config_from_options(role: str, config_file, options: dict):
    """The validated config; errors name the option (`--lr: ...`) and exit with status 1."""
    from pydantic import ValidationError

    from swarm.config import resolve

    given = {k: v for k, v in options.items() if v is not None and v != ()}
    given = {k: list(v) if isinstance(v, tuple) else v for k, v in given.items()}
    try:
        return resolve(role, Path(config_file) if config_file else None, given)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err.get("loc") else "config"
            lines.append(f"{option_name(field)}: {err['msg'].removeprefix('Value error, ')}")
        raise click.ClickException("; ".join(lines)) from None
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
