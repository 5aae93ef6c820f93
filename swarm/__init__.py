"""GEPO Swarm: peer-to-peer RL post-training of language models.

The core library. One concept per module:

- losses/ (package)  - the policy-loss registry: gepo, grpo, dr_grpo, bnpo, gspo, gmpo, topr, cispo,
                       plus the sampler-learner KL penalty; pure tensor functions.
- advantages.py      - group-normalised advantages (std, no-std, Beta normalisation).
- logprobs.py        - per-token log-probs of chosen tokens under a (temperature / top-k / top-p)
                       sampling distribution; shared by samplers and learners so that both agree.
- model/ (package)   - the embedded tiny Qwen3 policy and its tokenizer, built on first use.
- tasks/ (package)   - the built-in synthetic math task and the `datasets` loader.
- rewards.py         - reward registry (math-verify accuracy, format) and dotted-path rewards.
- evaluation.py      - pass@1 / greedy accuracy of a policy on a task (`swarm eval`).
- cli.py             - the `swarm` command (click); imports heavy libraries late.

Peers live in the top-level `peers/` package, the bootstrap node in `bootstrap/`.
"""

__version__ = "0.1.0"
