"""GEPO Swarm: peer-to-peer RL post-training of language models.

The project has three layers, and imports point down only (import-linter checks it in CI):

    swarm.cli              the `swarm` command, the demo, the local launcher, plots      (top)
    peers, bootstrap       learner, sampler, in-process trainer, bootstrap node: loops
    swarm (the rest)       the library below                                              (bottom)

The library, one concept per module:

- config/ (package)  - every setting and default: one pydantic model per role.
- losses/ (package)  - the policy-loss registry: gepo, grpo, dr_grpo, bnpo, gspo, gmpo, topr, cispo, m2po,
                       decoupled_ppo, tis_mis, opsm,
                       plus the sampler-learner KL penalty; pure tensor functions.
- advantages.py      - group-normalised advantages (std, no-std, Beta normalisation).
- logprobs.py        - per-token log-probs of chosen tokens under a (temperature / top-k / top-p)
                       sampling distribution; shared by samplers and learners so that both agree.
- rollouts.py        - rollout groups and their collation into tensors.
- rewards.py         - reward registry (math-verify accuracy, format) and dotted-path rewards; the
                       peers score with math-verify accuracy.
- tasks/ (package)   - the built-in synthetic math task and the `datasets` loader.
- model/ (package)   - the embedded tiny Qwen3 policy and its tokenizer; loading any causal LM.
- generation/        - generation backends behind one interface: transformers, vLLM (optional).
- sampling.py        - a backend and problems -> scored rollout groups.
- training.py        - the learner's optimisation step, learning-rate schedule and step metrics.
- intake.py          - what a learner accepts into a batch (staleness, age, re-scored rewards).
- evaluation.py      - pass@1 / greedy accuracy of a policy on a task.
- diagnostics.py     - the error of the estimated expected advantage under stale sampling.
- staleness.py       - delay distributions and a ring of past policies, for experiments.
- checkpoint.py      - learner checkpoints in Hugging Face format, with optimizer state.
- fabric/ (package)  - how peers find each other and move rollouts and weights: one interface,
                       two transports (hivemind, gRPC).
- health.py          - what `swarm status` flags as wrong (late heartbeats, refused rollouts, a stalled
                       learner, versions no sampler picks up), from the membership records.
- progress.py        - progress of long steps: a rich bar on a terminal, plain lines elsewhere.
- runlog.py          - what peers write to their run directory: ready.json, steps/events JSONL.
- reporting.py       - --report-to: the JSONL records mirrored to TensorBoard and wandb.
- signals.py         - SIGINT/SIGTERM stop a peer cleanly.

The ground floor, importing nothing of the project (so that any module may import it):

- paths.py           - where the project keeps files on the user's machine (the cache directory).
- hub.py             - the Hugging Face hub: offline? answering? a snapshot in its cache?
- tied_weights.py    - tied parameters published once (`unique_state`) and re-tied on load.
- heap.py            - freed heap handed back to the operating system (glibc's malloc_trim).
- lora.py            - LoRA runs: PEFT wrapping, the adapter as the published state, the base model's hash,
                       merge/unmerge, PEFT adapter directories (vLLM's LoRARequest reads them).
"""

__version__ = "0.1.0"
