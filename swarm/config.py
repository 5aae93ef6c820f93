"""Every setting and every default, in one place: one pydantic model per role, built from shared
groups of settings.

| role                         | model          | settings groups                                  |
|------------------------------|----------------|--------------------------------------------------|
| `swarm learner`              | LearnerConfig  | swarm, task, loss, optimizer, training, output   |
| in-process trainer           | TrainerConfig  | task, loss, optimizer, training, generation, ... |
| `swarm sampler`              | SamplerConfig  | swarm, task, generation, sampler, output         |
| `swarm bootstrap`            | BootstrapConfig| its own (it holds no model)                      |
| `swarm demo`                 | DemoConfig     | the trainer's, plus the local swarm's            |
| `swarm eval`                 | EvalConfig     | task, evaluation, generation                     |

The learner and the in-process trainer share `TrainingSettings` (the loss config, optimizer and
schedule), so they cannot drift apart. Names follow TRL's where a TRL user would look for them
(`learning_rate`, `num_generations`, `beta`, `epsilon` / `epsilon_high`, `max_completion_length`,
`max_grad_norm`, `seed`); our older names are accepted as aliases (`lr`, `group_size`, `kl_coef`,
`eps_low` / `eps_high`, `max_new_tokens`).

Values come from (lowest to highest precedence) these defaults, a config file (TOML, YAML or
JSON) and the command line, whose options are generated from these models (swarm/cli/options.py).
A config file holds shared keys at the top level and role-specific ones in a table named after
the role; the loss is a name or a table:

    run_id = "my-run"
    peers = ["/ip4/10.0.0.1/tcp/31337/p2p/Qm..."]
    [learner]
    learning_rate = 1e-5
    loss = { name = "gepo", beta = 0.005 }
    [sampler]
    num_generations = 16

This module imports neither torch nor hivemind (`swarm --help` builds its options from it).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

ROLES = ("learner", "sampler", "bootstrap", "demo", "eval")  # the tables a config file may hold
TRANSPORTS = ("hivemind", "grpc")  # swarm.fabric.transports implements exactly these
GENERATION_BACKENDS = ("transformers", "vllm")  # swarm.generation.make_backend builds exactly these
# The registered policy losses (swarm/losses registers exactly these; a test checks it). Listed here
# so that option choices and config validation need no torch import.
LOSS_NAMES = ("gepo", "grpo", "dr_grpo", "bnpo", "gspo", "gmpo", "topr", "cispo")


def check_peers(transport: str, peers: Sequence[str]) -> None:
    """Raise ValueError, saying what to pass instead, when `peers` do not fit `transport`."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of: {', '.join(TRANSPORTS)}")
    for addr in peers:
        if transport == "hivemind" and not str(addr).startswith("/"):
            raise ValueError(f"--peers {addr!r} is not a multiaddr; pass one like /ip4/1.2.3.4/tcp/31337/p2p/Qm... "
                             "(or use --transport grpc with the registry's HOST:PORT)")
        if transport == "grpc" and (str(addr).startswith("/") or ":" not in str(addr)):
            raise ValueError(f"--peers {addr!r}: with --transport grpc pass the registry's HOST:PORT, "
                             "as `swarm bootstrap --transport grpc` prints it")
    if transport == "grpc" and len(peers) != 1:
        raise ValueError("with --transport grpc pass exactly one --peers HOST:PORT (the registry)")


def check_bootstrap_peers(transport: str, peers: Sequence[str]) -> None:
    """What a bootstrap node may join: other hivemind nodes; a gRPC registry joins nothing."""
    if transport == "grpc":
        if peers:
            raise ValueError("a gRPC registry joins no other peers; drop --peers (or use --transport hivemind)")
        return
    check_peers(transport, peers)


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


def _aliased(model: type[BaseModel]) -> type[BaseModel]:
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


def same_as(model: type[BaseModel], name: str) -> Any:
    """The field `name` of `model`, for a config that offers the same setting with the same default."""
    return copy.copy(model.model_fields[name])


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# ---------------------------------------------------------------------------------------------
# The policy loss


class LossConfig(Settings):
    """Which policy loss to use and its knobs. Unset clip bounds take the loss's own defaults
    (its paper's: GRPO/GEPO 0.2, GSPO 3e-4 / 4e-4, GMPO 0.4 in log space, CISPO none / 0.28)."""

    name: Literal[LOSS_NAMES] = setting("gepo", group="loss", help="the policy loss")  # type: ignore[valid-type]
    epsilon: Optional[float] = setting(
        None, group="loss", aliases=("eps_low",), ge=0,
        help="lower clip: ratio >= 1 - epsilon (GMPO: of the log-ratio); unset: the loss's own")
    epsilon_high: Optional[float] = setting(
        None, group="loss", aliases=("eps_high",), ge=0,
        help="upper clip: ratio <= 1 + epsilon_high (DAPO's clip-higher); unset: the loss's own")
    beta: float = setting(
        0.005, group="loss", aliases=("kl_coef",), ge=0,
        help="coefficient of the sampler-learner k3 KL penalty (0.005 in the GEPO paper's heterogeneous "
             "runs; unlike TRL's beta it needs no reference model: it pulls towards the samplers' policy)")
    seq_logprob_mode: Literal["mean", "sum"] = setting(
        "mean", group="loss", help="sequence log-prob for sequence- and group-level weights: mean over tokens "
                                    "(the GEPO reference) or sum")
    gepo_expectation: Literal["group", "batch"] = setting(
        "group", group="loss", help="GEPO's E_q[q] over each prompt's group (the paper) or over the whole micro-batch "
                                     "(what the reference code does; for comparison only)")
    max_completion_length: Optional[int] = setting(
        None, group="loss", gt=0, help="Dr.GRPO's constant normaliser: the samplers' max_completion_length "
                                        "(unset: the batch's padded width)")


# ---------------------------------------------------------------------------------------------
# Groups of settings that several roles share


class SwarmSettings(Settings):
    """Where the swarm is and how this peer talks to it."""

    peers: list[str] = setting(list, group="swarm", validate_default=True,
                               help="address of a bootstrap node or any peer (repeatable): a multiaddr, or with "
                                    "--transport grpc the registry's HOST:PORT")
    transport: Literal[TRANSPORTS] = setting("hivemind", group="swarm",  # type: ignore[valid-type]
                                             help="hivemind (libp2p), or grpc where libp2p cannot run")
    run_id: str = setting("swarm", group="swarm", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                          help="the run to join")
    identity_dir: Optional[Path] = setting(None, group="swarm",
                                           help="where this peer's keys live (unset: ~/.cache/gepo-swarm/identity)")
    host: str = setting("127.0.0.1", group="swarm", help="address to listen on (0.0.0.0: every interface); over gRPC also "
                                                         "the address other peers are told, so give one they can reach")
    port: int = setting(0, group="swarm", ge=0, le=65535, help="TCP port to listen on (0: any free port)")
    heartbeat_s: float = setting(5.0, group="swarm", gt=0, help="seconds between membership heartbeats")

    @field_validator("peers")
    @classmethod
    def _need_peers(cls, peers: list[str]) -> list[str]:
        if not peers:
            raise ValueError("no --peers given: pass the address a bootstrap node (or any peer) prints, "
                             "or set peers = [...] in the config file")
        return peers

    @model_validator(mode="after")
    def _peers_fit_transport(self):
        check_peers(self.transport, self.peers)
        return self


class TaskSettings(Settings):
    """Which policy and task (every peer of a run must use the same)."""

    model: str = setting("embedded", group="task", help="policy: 'embedded', a model directory or a hub id")
    task: str = setting("arithmetic", group="task", help="'arithmetic', a local jsonl/json/parquet/csv file or a dataset id")
    difficulty: int = setting(2, group="task", ge=1, le=4, help="arithmetic task difficulty")
    question_column: str = setting("question", group="task", help="dataset tasks: the question column")
    answer_column: str = setting("answer", group="task", help="dataset tasks: the answer column")

    def task_options(self) -> dict:
        if self.task == "arithmetic":
            return {"difficulty": self.difficulty}
        return {"question_column": self.question_column, "answer_column": self.answer_column}


class TrainingSettings(Settings):
    """What the learner and the in-process trainer share: loss, optimizer, schedule, batch."""

    loss: LossConfig = setting(LossConfig, group="loss", help="the policy loss and its knobs")
    learning_rate: float = setting(1e-4, group="optimizer", aliases=("lr",), gt=0, help="AdamW learning rate")
    lr_warmup_steps: int = setting(5, group="optimizer", ge=0,
                                   help="linear learning-rate warm-up over the first versions (damps Adam's sign-like first steps)")
    max_grad_norm: float = setting(1.0, group="optimizer", ge=0, help="gradient clipping by global norm (0: off)")
    steps: int = setting(60, group="training", ge=1, help="stop when the policy reaches this version")
    groups_per_step: int = setting(
        32, group="training", ge=1,
        help="rollout groups (prompts, each with its num_generations completions) per optimizer step (the swarm "
             "learner steps on fewer when --wait-s passes without them); counted in groups, not completions as TRL's "
             "batch size is, since GEPO's expectation needs whole groups")
    max_staleness: int = setting(64, group="training", ge=0,
                                 help="groups more than this many versions behind are dropped (the paper's runs: 64)")
    seed: int = setting(0, group="training", help="random seed: torch's in the learner; the in-process trainer's prompt order "
                                                  "and sampling; the evaluation's sampling")

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_by_name(cls, value):
        return {"name": value} if isinstance(value, str) else value


class GenerationSettings(Settings):
    """How completions are sampled."""

    num_generations: int = setting(8, group="generation", aliases=("group_size",), ge=2,
                                   help="G: completions per prompt (the group GEPO's expectation is taken over)")
    max_completion_length: int = setting(16, group="generation", aliases=("max_new_tokens",), ge=1,
                                         help="longest completion, in tokens")
    temperature: float = setting(1.0, group="generation", gt=0, help="sampling temperature")


class EvalSettings(Settings):
    """Held-out evaluation (the trainer's and the demo's; `swarm eval` takes its defaults from here)."""

    eval_problems: int = setting(200, group="evaluation", aliases=("limit",), ge=1, help="held-out problems per evaluation")
    eval_samples: int = setting(4, group="evaluation", aliases=("samples",), ge=1, help="samples per problem for pass@1")


# ---------------------------------------------------------------------------------------------
# One config per role


class LearnerConfig(SwarmSettings, TaskSettings, TrainingSettings):
    """`swarm learner`: trains on rollouts from samplers and publishes versions."""

    max_age_s: float = setting(1800.0, group="training", gt=0, help="groups older than this many seconds are dropped")
    wait_s: float = setting(120.0, group="training", gt=0, help="say so when no rollouts arrive for this many seconds")
    run_dir: Optional[Path] = setting(None, group="output", help="logs, checkpoints and config (unset: runs/learner-TIME)")
    checkpoint_every: int = setting(10, group="output", ge=0, help="steps between checkpoints (0: only at exit)")
    keep_checkpoints: int = setting(3, group="output", ge=1, help="how many recent checkpoints to keep")
    resume: bool = setting(False, group="output", help="continue from the last checkpoint in --run-dir")
    ban_after: int = setting(8, group="swarm", ge=1, help="refused groups from one peer within --ban-window-s that get it banned")
    ban_window_s: float = setting(120.0, group="swarm", gt=0, help="window for counting a peer's refused groups, seconds")
    ban_s: float = setting(600.0, group="swarm", ge=0, help="how long a banned peer's rollouts are ignored, seconds")


class SamplerConfig(SwarmSettings, TaskSettings, GenerationSettings):
    """`swarm sampler`: generates and scores rollouts with the newest version it may use."""

    learner_keys: list[str] = setting(list, group="swarm", validate_default=True,
                                      help="the key a learner prints (repeatable); only its versions are used")
    sampler_id: Optional[str] = setting(None, group="sampler", help="name in logs and rollouts (unset: sampler-PID)")
    prompts_per_round: int = setting(8, group="sampler", ge=1, help="prompts per generation round")
    rounds: Optional[int] = setting(None, group="sampler", ge=1, help="stop after this many rounds (unset: until stopped)")
    backend: Literal[GENERATION_BACKENDS] = setting(  # type: ignore[valid-type]
        "transformers", group="sampler", help="generation backend: transformers (CPU or GPU) or vllm (GPU, the optional "
                                              "vllm extra; not yet verified on a GPU by this project)")
    device: str = setting("cpu", group="sampler", help="torch device of the transformers backend (cpu, cuda, cuda:1, ...)")
    wait_s: float = setting(60.0, group="sampler", gt=0,
                            help="at start-up, give up when no learner has announced a version for this many seconds")
    pickup_delay: str = setting("none", group="sampler",
                                help="latency simulation: seconds before using a new version: none | fixed:S | uniform:S | "
                                     "lognormal:LO,HI (the paper: 60,1920)")
    lag_steps: int = setting(0, group="sampler", ge=0, help="latency simulation: generate with a version at least this many steps old")
    run_dir: Optional[Path] = setting(None, group="output", help="metrics and events (unset: runs/SAMPLER_ID-TIME)")
    progress_every_s: float = setting(10.0, group="output", gt=0, help="seconds between progress lines and metrics records")

    @field_validator("learner_keys")
    @classmethod
    def _need_keys(cls, keys: list[str]) -> list[str]:
        if not keys:
            raise ValueError("no --learner-key given: pass the key the learner prints at start-up (only its versions are used)")
        from swarm.fabric.identity import decode_learner_key

        for key in keys:
            decode_learner_key(key)
        return keys

    @field_validator("pickup_delay")
    @classmethod
    def _delay(cls, spec: str) -> str:
        from swarm.staleness import SecondsDelay

        SecondsDelay.parse(spec)
        return spec


class TrainerConfig(TaskSettings, TrainingSettings, GenerationSettings, EvalSettings):
    """The in-process trainer (`swarm demo --in-process`, the staleness study): a learner trains on
    groups generated by past versions of its own policy, staleness drawn from `delay`."""

    delay: str = setting("none", group="staleness", help="staleness in steps: none | fixed:K | uniform:K | lognormal:LO,HI,STEP_S")
    virtual_samplers: int = setting(4, group="staleness", ge=1,
                                    help="each step's groups come from this many samplers, each with its own delay")
    eval_every: int = setting(10, group="evaluation", ge=1, help="steps between held-out evaluations")
    advantage_diagnostic_every: int = setting(
        0, group="evaluation", ge=0, help="steps between measurements of the error of the estimated expected advantage "
                                          "(swarm.diagnostics; 0: never; costs fresh samples)")

    @field_validator("delay")
    @classmethod
    def _delay(cls, spec: str) -> str:
        from swarm.staleness import DelayDistribution

        DelayDistribution.parse(spec)
        return spec


class BootstrapConfig(Settings):
    """`swarm bootstrap`: the node peers join through. It holds no model."""

    host: str = setting("0.0.0.0", group="swarm", help="address to listen on (0.0.0.0: every IPv4 interface)")
    port: int = setting(31337, group="swarm", ge=0, le=65535, help="TCP port to listen on (0: any free port)")
    transport: Literal[TRANSPORTS] = same_as(SwarmSettings, "transport")  # type: ignore[valid-type]
    peers: list[str] = setting(list, group="swarm", help="other bootstrap nodes or peers to connect to (multiaddr; repeatable)")
    run_id: str = same_as(SwarmSettings, "run_id")
    identity: Optional[Path] = setting(None, group="swarm", help="libp2p key file: keeps the peer id across restarts "
                                                                 "(unset: ~/.cache/gepo-swarm/identity/bootstrap.p2p.key)")
    run_dir: Optional[Path] = setting(None, group="output", help="ready file and status records (unset: runs/bootstrap-TIME)")
    status_every_s: float = setting(60.0, group="output", gt=0, help="seconds between status lines and records")

    @model_validator(mode="after")
    def _peers_fit_transport(self):
        check_bootstrap_peers(self.transport, self.peers)
        return self


class EvalConfig(TaskSettings, EvalSettings):
    """`swarm eval`: accuracy of a policy on a task's held-out split."""

    split: Literal["train", "test"] = setting("test", group="evaluation", help="which split to evaluate on")
    temperature: float = same_as(GenerationSettings, "temperature")
    max_completion_length: int = same_as(GenerationSettings, "max_completion_length")
    greedy: bool = setting(True, group="evaluation", help="also measure temperature-0 accuracy")
    backend: Literal[GENERATION_BACKENDS] = same_as(SamplerConfig, "backend")  # type: ignore[valid-type]
    device: str = same_as(SamplerConfig, "device")
    seed: int = same_as(TrainingSettings, "seed")


class DemoConfig(TrainerConfig):
    """`swarm demo`: a whole local swarm (bootstrap, learner, samplers as processes) on this machine,
    or with `in_process` the in-process trainer; accuracy before and after."""

    samplers: int = setting(2, group="swarm", ge=1, le=16, help="sampler processes")
    transport: Literal[TRANSPORTS] = same_as(SwarmSettings, "transport")  # type: ignore[valid-type]
    prompts_per_round: int = same_as(SamplerConfig, "prompts_per_round")
    pickup_delay: str = same_as(SamplerConfig, "pickup_delay")
    in_process: bool = setting(False, group="staleness", help="train in this one process instead (no network; --delay "
                                                              "simulates staleness)")
    run_dir: Optional[Path] = setting(None, group="output", help="where logs, checkpoints and the plot go (unset: runs/demo-TIME)")

    _delay_of_pickup = field_validator("pickup_delay")(SamplerConfig._delay.__func__)

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(**self.model_dump(include=set(TrainerConfig.model_fields)))


for _model in (LossConfig, SwarmSettings, TaskSettings, TrainingSettings, GenerationSettings, EvalSettings,
               LearnerConfig, SamplerConfig, TrainerConfig, BootstrapConfig, EvalConfig, DemoConfig):
    _aliased(_model)

CONFIGS: dict[str, type[Settings]] = {"learner": LearnerConfig, "sampler": SamplerConfig, "bootstrap": BootstrapConfig,
                                      "demo": DemoConfig, "eval": EvalConfig}


def field_names_of(model: type[BaseModel], name: str) -> list[str]:
    """A field's name and its aliases."""
    extra = model.model_fields[name].json_schema_extra
    return [name, *(extra.get("aliases", ()) if isinstance(extra, dict) else ())]


def field_names(model: type[BaseModel]) -> set[str]:
    """Every key a config file may use for `model`: field names and their aliases."""
    return {key for name in model.model_fields for key in field_names_of(model, name)}


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
    values = {k: v for k, v in data.items() if k not in ROLES}
    section = data.get(role, {})
    if not isinstance(section, dict):
        raise ValueError(f"config file {path}: [{role}] must be a table of settings")
    values.update(section)
    unknown = sorted(k for k in values if k not in field_names(model))
    if unknown:
        raise ValueError(f"config file {path}: unknown setting(s) {', '.join(unknown)} for a {role}; "
                         f"known: {', '.join(sorted(model.model_fields))}")
    canonical = {alias: name for name in model.model_fields for alias in field_names_of(model, name)}
    return {canonical.get(k, k): v for k, v in values.items()}  # `lr` at the top, `learning_rate` in [learner]: the table wins


def resolve(role: str, config_file: Path | None, cli_values: dict[str, Any]) -> Settings:
    """Defaults < config file < command line. Raises pydantic's ValidationError on bad values."""
    values = read_config_file(config_file, role) if config_file else {}
    for key, value in cli_values.items():
        if isinstance(value, dict) and isinstance(values.get(key), (dict, str)):
            base = values[key] if isinstance(values[key], dict) else {"name": values[key]}
            values[key] = {**base, **value}  # a nested table (the loss): the command line wins field by field
        else:
            values[key] = value
    return CONFIGS[role](**values)


def write_config(config: BaseModel, path: Path) -> Path:
    """The resolved configuration as YAML (readable by `--config`)."""
    import yaml

    data = json.loads(config.model_dump_json())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
