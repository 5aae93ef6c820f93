"""Peer configurations: one pydantic model per role, filled from (lowest to highest precedence) the
model's defaults, an optional config file (TOML, YAML or JSON) and the options given on the command
line. The command-line options are generated from the same models (`options_from`), so a default
or a description lives in one place, and the resolved configuration is written to the run
directory, from where `--config` reads it back.

A config file holds shared keys at the top level and role-specific ones in a table named after the
role, e.g.:

    run_id = "my-run"
    peers = ["/ip4/10.0.0.1/tcp/31337/p2p/Qm..."]
    [learner]
    lr = 1e-5
    [sampler]
    group_size = 16
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ROLES = ("learner", "sampler")


class PeerConfig(BaseModel):
    """What every peer needs: where the swarm is, which run, which policy and task."""

    model_config = ConfigDict(extra="forbid")

    peers: list[str] = Field(default_factory=list, validate_default=True,
                             description="multiaddr of a bootstrap node or any peer (repeatable); with --transport grpc, the registry's HOST:PORT")
    transport: Literal["hivemind", "grpc"] = Field("hivemind", description="hivemind (libp2p) or grpc (fallback where libp2p cannot run)")
    run_id: str = Field("swarm", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="the run to join")
    model: str = Field("embedded", description="policy: 'embedded', a model directory or a hub id (all peers the same)")
    task: str = Field("arithmetic", description="'arithmetic', a local jsonl/json/parquet/csv file or a dataset id")
    difficulty: int = Field(2, ge=1, le=4, description="arithmetic task difficulty")
    question_column: str = Field("question", description="dataset tasks: the question column")
    answer_column: str = Field("answer", description="dataset tasks: the answer column")
    identity_dir: Optional[Path] = Field(None, description="where this peer's keys live (default ~/.cache/gepo-swarm/identity)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(0, ge=0, le=65535, description="TCP port (0: any free port)")
    heartbeat_s: float = Field(5.0, gt=0, description="seconds between membership heartbeats")

    @field_validator("peers")
    @classmethod
    def _need_peers(cls, peers: list[str]) -> list[str]:
        if not peers:
            raise ValueError("no --peers given: pass the address a bootstrap node (or any peer) prints, "
                             "or set peers = [...] in the config file")
        return peers

    @model_validator(mode="after")
    def _peers_fit_transport(self):
        for addr in self.peers:
            if self.transport == "hivemind" and not addr.startswith("/"):
                raise ValueError(f"--peers {addr!r} is not a multiaddr; pass one like /ip4/1.2.3.4/tcp/31337/p2p/Qm... "
                                 "(or use --transport grpc with the registry's HOST:PORT)")
            if self.transport == "grpc" and (addr.startswith("/") or ":" not in addr):
                raise ValueError(f"--peers {addr!r}: with --transport grpc pass the registry's HOST:PORT, "
                                 "as `swarm bootstrap --transport grpc` prints it")
        if self.transport == "grpc" and len(self.peers) > 1:
            raise ValueError("with --transport grpc pass exactly one --peers HOST:PORT (the registry)")
        return self

    def task_options(self) -> dict:
        if self.task == "arithmetic":
            return {"difficulty": self.difficulty}
        return {"question_column": self.question_column, "answer_column": self.answer_column}


class LearnerConfig(PeerConfig):
    loss: str = Field("gepo", description="policy loss: gepo, grpo, gspo, dr_grpo, bnpo, gmpo, topr, cispo")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    lr_warmup_steps: int = Field(5, ge=0, description="linear learning-rate warm-up over the first versions")
    groups_per_step: int = Field(16, ge=1, description="rollout groups per optimizer step")
    max_staleness: int = Field(64, ge=0, description="groups more than this many versions behind are dropped")
    max_age_s: float = Field(1800.0, gt=0, description="groups older than this many seconds are dropped")
    steps: int = Field(100, ge=1, description="stop when the policy reaches this version")
    wait_s: float = Field(120.0, gt=0, description="say so when no rollouts arrive for this long")
    run_dir: Optional[Path] = Field(None, description="logs, checkpoints and config (default runs/learner-TIME)")
    checkpoint_every: int = Field(10, ge=0, description="steps between checkpoints (0: only at exit)")
    keep_checkpoints: int = Field(3, ge=1, description="how many recent checkpoints to keep")
    resume: bool = Field(False, description="continue from the last checkpoint in --run-dir")
    ban_after: int = Field(8, ge=1, description="refused groups from one peer within ban-window-s that get it banned")
    ban_window_s: float = Field(120.0, gt=0, description="window for counting a peer's refused groups")
    ban_s: float = Field(600.0, ge=0, description="how long a banned peer's rollouts are ignored")

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        from swarm.losses import LossConfig

        LossConfig(name=name)  # raises naming the registered losses
        return name


class SamplerConfig(PeerConfig):
    learner_keys: list[str] = Field(default_factory=list, validate_default=True, description="the key a learner prints (repeatable)")
    sampler_id: Optional[str] = Field(None, description="name in logs and rollouts (default sampler-PID)")
    prompts_per_round: int = Field(8, ge=1, description="prompts per generation round")
    group_size: int = Field(8, ge=2, description="G: completions per prompt")
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    rounds: Optional[int] = Field(None, ge=1, description="stop after this many rounds (default: until stopped)")
    wait_s: float = Field(60.0, gt=0, description="give up when no learner has announced a version for this long")
    pickup_delay: str = Field("none", description="latency simulation: delay before using a new version, in seconds: "
                              "none | fixed:S | uniform:S | lognormal:LO,HI (the paper: 60,1920)")
    lag_steps: int = Field(0, ge=0, description="latency simulation: generate with a version at least this many steps old")
    progress_every_s: float = Field(10.0, gt=0, description="seconds between progress lines")

    @field_validator("learner_keys")
    @classmethod
    def _need_keys(cls, keys: list[str]) -> list[str]:
        if not keys:
            raise ValueError("no --learner-key given: pass the key the learner prints at start-up (only its versions are used)")
        from peers.common import decode_learner_key

        for key in keys:
            decode_learner_key(key)
        return keys

    @field_validator("pickup_delay")
    @classmethod
    def _delay(cls, spec: str) -> str:
        from swarm.staleness import SecondsDelay

        SecondsDelay.parse(spec)
        return spec


CONFIGS: dict[str, type[PeerConfig]] = {"learner": LearnerConfig, "sampler": SamplerConfig}


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
    values = {k: v for k, v in data.items() if k not in ROLES}
    section = data.get(role, {})
    if not isinstance(section, dict):
        raise ValueError(f"config file {path}: [{role}] must be a table of settings")
    values.update(section)
    known = CONFIGS[role].model_fields
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        raise ValueError(f"config file {path}: unknown setting(s) {', '.join(unknown)} for a {role}; "
                         f"known: {', '.join(sorted(known))}")
    return values


def resolve(role: str, config_file: Path | None, cli_values: dict[str, Any]) -> PeerConfig:
    """Defaults < config file < command line. Raises pydantic's ValidationError on bad values."""
    values = read_config_file(config_file, role) if config_file else {}
    values.update(cli_values)
    return CONFIGS[role](**values)


def write_config(config: PeerConfig, path: Path) -> Path:
    """The resolved configuration as YAML (readable by `--config`)."""
    import yaml

    data = json.loads(config.model_dump_json())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
