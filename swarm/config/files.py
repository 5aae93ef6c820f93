"""Config files: read the keys that apply to a role (TOML, YAML or JSON), resolve defaults < file
< command line, and write the resolved config to a run directory (where `--config` reads it back)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel

from swarm.config.base import Settings, field_names, field_names_of
from swarm.config.environment import environment_values
from swarm.config.hints import unknown_setting
from swarm.config.roles import CONFIGS, ROLES


def read_config_file(path: Path, role: str) -> dict[str, Any]:
    """The keys that apply to `role`: the file's top level (minus role tables) updated by its `[role]`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    if path.suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ValueError(f"config file {path}: use a .toml, .yaml/.yml or .json file")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib

            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # noqa: BLE001  each parser has its own error type
        raise ValueError(f"config file {path} could not be parsed: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table of settings, not {type(data).__name__}")
    model = CONFIGS[role]
    # top-level keys are shared by every role that reads the file: each must be one of this role's
    shared = {k: v for k, v in data.items() if k not in ROLES}
    section = data.get(role, {})
    if not isinstance(section, dict):
        raise ValueError(f"config file {path}: [{role}] must be a table of settings")
    unknown = sorted(k for k in (*shared, *section) if k not in field_names(model))
    if unknown:
        raise ValueError(f"config file {path}: unknown setting(s): " + "; ".join(unknown_setting(key, role) for key in unknown)
                         + f" (`swarm config {role}` prints every {role} setting)")
    return merge(canonical(model, shared), canonical(model, section))  # the role's table wins, field by field


def canonical(model: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    """`values` under the fields' own names (aliases such as `lr` renamed), nested tables too; a
    nested model given by name (the loss: "gepo") becomes its table ({"name": "gepo"})."""
    out = {}
    for key, value in values.items():
        name = next((n for n in model.model_fields if key in field_names_of(model, n)), key)
        nested = model.model_fields[name].annotation if name in model.model_fields else None
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            value = canonical(nested, {"name": value} if isinstance(value, str) else value) if isinstance(value, (str, dict)) else value
        out[name] = value
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`; nested tables (the loss) are merged field by field."""
    merged = dict(base)
    for key, value in over.items():
        merged[key] = merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def resolve(role: str, config_file: Path | None, cli_values: dict[str, Any], environ: Mapping[str, str] | None = None) -> Settings:
    """Defaults < config file < `GEPO_SWARM_*` environment variables (`environ`; None: none) <
    command line, nested tables field by field. Raises pydantic's ValidationError on bad values."""
    model = CONFIGS[role]
    values = read_config_file(config_file, role) if config_file else {}
    values = merge(values, environment_values(role, environ or {}))
    return model(**merge(values, canonical(model, cli_values)))


def write_config(config: BaseModel, path: Path) -> Path:
    """The resolved configuration as YAML (readable by `--config`)."""
    import yaml

    data = json.loads(config.model_dump_json())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
