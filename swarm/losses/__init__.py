"""The policy-loss family: one registry of pure tensor functions and one dispatch point.

- base.py            - LossInputs / LossOutputs, reductions, normalisers, PPO clip helper.
- registry.py        - `register_loss`, `LOSSES`, `compute_loss` (the dispatch point); the loss
                       settings (`LossConfig`) live with every other setting in swarm/config/.
- kl.py              - k3 sampler-learner KL penalty and the KL(sampler || learner) metric.
- token_level.py     - grpo, dr_grpo, bnpo, cispo.
- sequence_level.py  - gspo, gmpo, topr (the default: docs/staleness.md, "Which loss to use").
- group_level.py     - gepo.
- off_policy.py      - m2po, decoupled_ppo, tis_mis, opsm: objectives built for stale rollouts (and
                       why VCPO is not one of them).
- diagnostics.py     - per-loss metrics by sign of advantage (clip fractions, GEPO's weight split).
- step_diagnostics.py - per-step gradient and movement measures (`StepDiagnostics`); above the loss
                       modules, since it computes whichever loss is configured.
"""

from swarm.losses.base import LossInputs, LossOutputs
from swarm.losses.registry import LOSSES, LossConfig, LossSpec, clip_range, compute_loss, register_loss

# Importing the modules registers their losses.
from swarm.losses import group_level, off_policy, sequence_level, token_level  # noqa: E402,F401  isort:skip

__all__ = ["LOSSES", "LossConfig", "LossInputs", "LossOutputs", "LossSpec", "clip_range", "compute_loss", "register_loss"]
