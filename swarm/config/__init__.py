"""Every setting and every default, in one package: one pydantic model per role, built from shared
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

Values come from (lowest to highest precedence) the defaults, a config file (TOML, YAML or
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

This package imports neither torch nor hivemind (`swarm --help` builds its options from it).

- base.py      - `Settings`, `setting()` (a field's --help group and aliases), `default_of`, `same_as`.
- settings.py  - the shared groups (swarm, task, loss, training, generation, evaluation), their
                 defaults, and which peer addresses fit which transport.
- roles.py     - one config per role, and `CONFIGS`.
- files.py     - config files: read, resolve with the command line, write.
"""

from swarm.config.base import Settings, default_of, field_names, field_names_of, same_as, setting
from swarm.config.files import read_config_file, resolve, write_config
from swarm.config.roles import (
    CONFIGS,
    ROLES,
    BootstrapConfig,
    DemoConfig,
    EvalConfig,
    LearnerConfig,
    SamplerConfig,
    TrainerConfig,
)
from swarm.config.settings import (
    GENERATION_BACKENDS,
    LOSS_NAMES,
    TRANSPORTS,
    EvalSettings,
    GenerationSettings,
    LossConfig,
    SwarmSettings,
    TaskSettings,
    TrainingSettings,
    check_announce_addr,
    check_bootstrap_peers,
    check_insecure,
    check_peers,
    split_host_port,
)

__all__ = [
    "CONFIGS", "GENERATION_BACKENDS", "LOSS_NAMES", "ROLES", "TRANSPORTS", "BootstrapConfig", "DemoConfig", "EvalConfig",
    "EvalSettings", "GenerationSettings", "LearnerConfig", "LossConfig", "SamplerConfig", "Settings", "SwarmSettings",
    "TaskSettings", "TrainerConfig", "TrainingSettings", "check_announce_addr", "check_bootstrap_peers", "check_insecure", "check_peers", "default_of",
    "field_names", "field_names_of", "read_config_file", "resolve", "same_as", "setting", "split_host_port", "write_config",
]
