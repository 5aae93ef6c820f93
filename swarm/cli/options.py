"""Command-line options generated from the role configs (swarm/config/), so that an option's
name, choices, default and description live in one place; `--help` groups them (swarm, task,
loss, optimizer, ...), and errors map to exit statuses the same way in every command:

- 2, a usage error: a bad option value, a bad or missing config file, input that cannot be used
  (click prints the usage line and the message);
- 1, a failure while running: the swarm cannot be reached, no learner answered, ...

Only options the user actually gave on the command line override the config file (click tells
which: `get_parameter_source`); the defaults click shows are the models' own.
"""

from __future__ import annotations

import os
import typing
from contextlib import contextmanager
from pathlib import Path

import click
from pydantic import BaseModel

from swarm.config import resolve
from swarm.config.base import GROUP_ORDER

# option names kept short or singular where the field name reads badly on a command line
OPTION_NAMES = {"learner_keys": "--learner-key", "max_age_s": "--max-age", "name": "--loss"}
SHORT_NAMES = {"eval_samples": "-k"}  # pass@k's k, as `swarm eval -k 4` has always read
# Failures a user can fix by changing what they typed: exit 2 with the usage line.
USAGE_ERRORS = (ValueError, FileNotFoundError, PermissionError)


def option_name(field: str) -> str:
    return OPTION_NAMES.get(field, "--" + field.replace("_", "-"))


class GroupedOption(click.Option):
    """An option that knows its --help section."""

    def __init__(self, *args, group: str = "other", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group


class GroupedCommand(click.Command):
    """Writes the options of --help in sections, in GROUP_ORDER; an option another role takes says
    so ("--num-generations is a sampler option: pass it to `swarm sampler`")."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            hint = role_hint(exc.option_name, self.name)
            if hint:
                exc.message = f"No such option: {exc.option_name}. {hint}"
                exc.possibilities = None  # click's guess ("did you mean --max-new-tokens") would mislead
            raise

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "group", "other"), []).append(record)
        for group in sorted(sections, key=lambda g: GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER)):
            with formatter.section(f"{group.capitalize()} options"):
                formatter.write_dl(sections[group])


def role_hint(option: str, role: str | None) -> str | None:
    """Where an option this role's command does not take belongs, if another role's command takes it."""
    from swarm.config import CONFIGS
    from swarm.config.hints import belongs_elsewhere

    if role not in CONFIGS:
        return None
    for other in CONFIGS.values():
        for _, name, field in _options_of(other):
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if option in (option_name(name), *(option_name(a) for a in extra.get("aliases", ()))):
                return belongs_elsewhere(name, role, spelled=option, as_option=True)
    return None


def _click_type(annotation):
    """(click type, multiple) for a field annotation: T, Optional[T], Annotated[T, ...], Literal[...] or list[T]."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _click_type(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is list:
        return _click_type(typing.get_args(annotation)[0])[0], True
    if typing.get_origin(annotation) is typing.Literal:
        return click.Choice([str(a) for a in typing.get_args(annotation)]), False
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    if typing.get_origin(base) in (typing.Literal, typing.Annotated):
        return _click_type(base)
    return {int: click.INT, float: click.FLOAT, str: click.STRING, Path: click.Path(), bool: bool}.get(base, click.STRING), False


def _nested_model(annotation) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _options_of(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, object]]:
    """(destination, field name, FieldInfo) for every field, nested models (the loss) flattened:
    their fields go to destination "loss.epsilon" and the like. A nested field named like one of
    the model's own (the loss's max_completion_length where the model samples too) is left to
    config files: one option name, one meaning."""
    found = []
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is not None:
            found += [o for o in _options_of(nested, prefix=f"{prefix}{name}.") if o[1] not in model.model_fields]
        else:
            found.append((f"{prefix}{name}", name, field))
    return found


def config_options(model: type[BaseModel]):
    """Decorator: one grouped option per (flattened) field of `model`, plus --config."""

    def decorate(func):
        for dest, name, field in reversed(_options_of(model)):
            kind, multiple = _click_type(field.annotation)
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            names = [option_name(name)] + [option_name(a) for a in extra.get("aliases", ())] + \
                ([SHORT_NAMES[name]] if name in SHORT_NAMES else [])
            default = field.get_default(call_default_factory=True)
            common = dict(default=default, help=field.description or "", group=extra.get("group", "other"),
                          show_default=default not in (None, []), cls=GroupedOption)
            param = dest.replace(".", "__")
            if kind is bool:  # both spellings: a config file's `resume: true` can be turned off here
                func = click.option(f"{names[0]}/--no-{name.replace('_', '-')}", param, **{**common, "show_default": False})(func)
            else:
                func = click.option(*names, param, type=kind, multiple=multiple, **common)(func)
        return click.option("--config", "config_file", type=click.Path(dir_okay=False), cls=GroupedOption, group="output",
                            help="TOML, YAML or JSON file with settings; options given here take precedence")(func)

    return decorate


def given_values(options: dict) -> dict:
    """The options the user gave on the command line, nested back into the config's shape
    ("loss__beta" -> loss.beta)."""
    ctx = click.get_current_context(silent=True)
    given: dict = {}
    for key, value in options.items():
        source = ctx.get_parameter_source(key) if ctx is not None else None
        if value is None or value == () or source in (click.core.ParameterSource.DEFAULT, None):
            continue
        value = list(value) if isinstance(value, tuple) else value
        head, _, tail = key.partition("__")
        if tail:
            given.setdefault(head, {})[tail] = value
        else:
            given[key] = value
    return given


def validation_message(exc) -> str:
    """One line per bad field of a pydantic ValidationError, named as its option."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if not str(p).isdigit()]
        field = loc[-1] if loc else "config"
        lines.append(f"{option_name(field) if loc else 'config'}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)


def config_from_options(role: str, config_file, options: dict):
    """The validated config of `role`; bad values and bad config files are usage errors (exit 2)."""
    with user_errors():
        return resolve(role, Path(config_file) if config_file else None, given_values(options), environ=os.environ)


@contextmanager
def user_errors(*failures: type[BaseException]):
    """Bad input becomes a usage error (exit 2); the `failures` given (a swarm that cannot be
    reached, ...) a one-line error with exit status 1. Neither prints a traceback."""
    from pydantic import ValidationError

    try:
        yield
    except ValidationError as exc:
        raise click.UsageError(validation_message(exc)) from exc
    except USAGE_ERRORS as exc:
        raise click.UsageError(str(exc)) from exc
    except failures as exc:
        raise click.ClickException(str(exc)) from exc
