"""One config per role, built from the shared settings groups (settings.py); CONFIGS maps each role
name (and config-file table) to its model."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import field_validator, model_validator

from swarm.config.base import Settings, aliased, same_as, setting
from swarm.config.learner_keys import decode_learner_key
from swarm.config.settings import (
    GENERATION_BACKENDS,
    TRANSPORTS,
    DashboardSettings,
    DeviceSettings,
    Directory,
    EvalSettings,
    GenerationSettings,
    ListenHost,
    LoraSettings,
    LossConfig,
    ReportSettings,
    SwarmSettings,
    TaskSettings,
    TrainingSettings,
    check_announce_addr,
    check_bootstrap_peers,
    check_insecure,
)
from swarm.staleness import DelayDistribution, SecondsDelay

ROLES = ("learner", "sampler", "bootstrap", "demo", "eval")  # the tables a config file may hold


# ---------------------------------------------------------------------------------------------
# One config per role


# The embedded policy answers in a dozen tokens; a real model reasons for hundreds before its answer
REAL_MODEL_COMPLETION_LENGTH = 1024


def real_model_completion_length(config):
    """A model other than the embedded one gets REAL_MODEL_COMPLETION_LENGTH completion tokens
    unless max_completion_length was given."""
    if "max_completion_length" not in config.model_fields_set and config.model != "embedded":
        config.max_completion_length = REAL_MODEL_COMPLETION_LENGTH
    return config


class LearnerConfig(SwarmSettings, TaskSettings, TrainingSettings, DeviceSettings, ReportSettings, DashboardSettings):
    """`swarm learner`: trains on rollouts from samplers and publishes versions."""

    dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto", group="device", help="precision of forward and backward: bfloat16 runs them under autocast with float32 "
                                     "master weights and optimizer state, and publishes versions in bfloat16 (what GPU "
                                     "samplers run); auto is bfloat16 on a GPU, float32 on a CPU")

    # The run's sampling settings: announced with every version, samplers generate with them, and
    # groups sampled otherwise are refused
    temperature: float = same_as(GenerationSettings, "temperature", help="the run's sampling temperature (samplers use it)")
    top_k: int = same_as(GenerationSettings, "top_k", help="the run's top-k (0: off; samplers use it)")
    top_p: float = same_as(GenerationSettings, "top_p", help="the run's top-p (1: off; samplers use it)")
    max_completion_length: int = same_as(GenerationSettings, "max_completion_length",
                                         help="the run's longest completion in tokens (samplers use it; longer ones are refused)")
    max_age_s: float = setting(1800.0, group="training", gt=0, help="groups older than this many seconds are dropped")
    fresh_gap_warning: float = setting(
        0.05, group="training", gt=0, help="warn when samplers' log-probs on groups of the current version differ from the "
                                           "learner's by more than this per token (a failed weight sync; bf16 samplers: ~0.002)")
    wait_s: float = setting(120.0, group="training", gt=0, help="say so when no rollouts arrive for this many seconds")
    run_dir: Optional[Directory] = setting(None, group="output", help="logs, checkpoints and config (unset: runs/learner-TIME)")
    checkpoint_every: int = setting(10, group="output", ge=0, help="steps between checkpoints (0: only at exit)")
    keep_checkpoints: int = setting(3, group="output", ge=1, help="how many recent checkpoints to keep")
    resume: bool = setting(False, group="output", help="continue from the last checkpoint in --run-dir")
    resume_from: Optional[Path] = setting(
        None, group="output", help="continue from this checkpoint directory (RUN_DIR/checkpoints/version-N) rather than "
                                   "the newest: one of --run-dir's own, or another run's (then --run-dir must be new)")
    ban_after: int = setting(8, group="swarm", ge=1, help="refused groups from one peer within --ban-window-s that get it banned")
    ban_window_s: float = setting(120.0, group="swarm", gt=0, help="window for counting a peer's refused groups, seconds")
    ban_s: float = setting(600.0, group="swarm", ge=0, help="how long a banned peer's rollouts are ignored, seconds")
    certificate: Optional[str] = setting(
        None, group="swarm", help="join the run as one more learner: the run owner's certificate for this learner's key "
                                  "(`swarm authorize` prints it; the token or a file holding it). Unset: this learner "
                                  "owns the run, and its key is the one samplers pin")
    publish_isolation: Literal["auto", "process", "thread"] = setting(
        "auto", group="swarm", help="where each version's hash, delta and undo delta are encoded: process (a process of "
                                    "its own, the state passed through shared memory: the encoding never holds the GIL "
                                    "the training thread needs for its GPU kernel launches), thread (in the learner's "
                                    "process: no shared memory, /dev/shm needs no room for a few versions, no child "
                                    "to start), or auto: process where the learner trains on a GPU, or on a CPU where a "
                                    "version is 32 MiB or more (there at idle priority: it takes only the CPU time "
                                    "training leaves, and skips versions rather than slow the steps), else thread")
    averaging_timeout_s: float = setting(
        30.0, group="swarm", gt=0, help="several learners: how long a step waits for the others' gradients before it "
                                        "steps alone (those left out then download the state and catch up)")

    _completion_length = model_validator(mode="after")(real_model_completion_length)
    eval_every: int = setting(
        0, group="evaluation", ge=0,
        help="versions between held-out evaluations of the learner's own policy: pass@1 on the task's test problems "
             "(eval_pass_at_1 in steps.jsonl, the trackers and the dashboard); 0: none. It generates on the learner, "
             "between steps: keep --eval-problems small on a CPU")
    eval_problems: int = setting(32, group="evaluation", ge=1, help="held-out problems per learner evaluation")
    eval_samples: int = same_as(EvalSettings, "eval_samples")
    verify_fraction: float = setting(
        0.4, group="swarm", ge=0, le=1, help="share of groups whose log-probs the learner recomputes at the claimed version, "
                                             "drawn from the operating system's randomness (a sampler cannot predict them); "
                                             "0.4 bans a liar within 16 of its lying groups with 99.7% probability "
                                             "(swarm/verification.py; 0: trust samplers)")
    verify_tolerance: float = setting(
        0.1, group="swarm", gt=0, help="largest mean absolute per-token log-prob gap of an honest completion (calibrated "
                                       "on float32, bfloat16 and float16 samplers: benchmarks/logprob_tolerance.py); a "
                                       "group above it is refused")
    verify_ban_after: int = setting(
        2, group="swarm", ge=1, help="groups over --verify-tolerance among a sampler's last --verify-ban-window checked "
                                     "groups that get it banned (one is refused without a ban: an honest GPU sampler can "
                                     "come close to the tolerance; benchmarks/ban_rate.py)")
    verify_ban_window: int = setting(
        64, group="swarm", ge=1, help="how many of a sampler's most recent checked groups --verify-ban-after counts over")

    @model_validator(mode="after")
    def _ban_fits_its_window(self):
        if self.verify_ban_after > self.verify_ban_window:
            raise ValueError(f"verify_ban_after {self.verify_ban_after} cannot exceed verify_ban_window {self.verify_ban_window}: "
                             "a ban counts groups over the tolerance among that many checked groups; raise --verify-ban-window")
        return self


class SamplerConfig(SwarmSettings, TaskSettings, DeviceSettings, ReportSettings, DashboardSettings):
    """`swarm sampler`: generates and scores rollouts with the newest version it may use, sampled
    as the learner announces (temperature, top-k, top-p, longest completion)."""

    num_generations: int = same_as(GenerationSettings, "num_generations")

    learner_keys: list[str] = setting(list, group="swarm",
                                      help="the key a learner prints (repeatable); only its versions are used")
    learner_key_file: Optional[Path] = setting(None, group="swarm",
                                               help="a file holding a learner's key (the learner writes RUN_DIR/learner.key)")
    sampler_id: Optional[str] = setting(None, group="sampler", help="name in logs and rollouts (unset: sampler-PID)")
    prompts_per_round: int = setting(8, group="sampler", ge=1, help="prompts per generation round")
    rounds: Optional[int] = setting(None, group="sampler", ge=1, help="stop after this many rounds (unset: until stopped)")
    backend: Literal[GENERATION_BACKENDS] = setting(  # type: ignore[valid-type]
        "transformers", group="sampler", help="generation backend: transformers (CPU or GPU) or vllm (GPU, the optional "
                                              "vllm extra; not yet verified on a GPU by this project)")
    gpu_memory_utilization: float = setting(0.85, group="vllm", gt=0, le=1,
                                            help="vllm backend: share of the GPU's memory the engine may take")
    max_model_len: Optional[int] = setting(None, group="vllm", ge=1, help="vllm backend: longest prompt + completion "
                                                                           "(unset: the model's own context)")
    tensor_parallel_size: int = setting(1, group="vllm", ge=1, help="vllm backend: GPUs one engine spans")
    enforce_eager: bool = setting(False, group="vllm", help="vllm backend: no CUDA graphs (slower; starts faster, less memory)")
    max_lora_rank: int = setting(0, group="vllm", ge=0, help="vllm backend: serve LoRA runs' adapters up to this rank "
                                                             "(vLLM's enable_lora and max_lora_rank; 0: full fine-tuning "
                                                             "runs only: the engine is built before the run is known)")
    lora_merged: bool = setting(
        False, group="lora", help="transformers backend, LoRA runs: merge the adapter into the base weights (no adapter "
                                  "matmuls per token, but each version unmerges and merges every adapted layer, "
                                  "rounding the base weights in their dtype) instead of running it beside them (a version "
                                  "swap copies the adapter alone; benchmarks/lora.py measures both)")
    wait_s: float = setting(60.0, group="sampler", gt=0,
                            help="at start-up, give up when no learner has announced a version for this many seconds")
    pickup_delay: str = setting("none", group="sampler",
                                help="latency simulation: seconds before using a new version: none | fixed:S | uniform:S | "
                                     "lognormal:LO,HI (the paper: 60,1920)")
    lag_steps: int = setting(0, group="sampler", ge=0, help="latency simulation: generate with a version at least this many steps old")
    run_dir: Optional[Directory] = setting(None, group="output", help="metrics and events (unset: runs/SAMPLER_ID-TIME)")
    progress_every_s: float = setting(10.0, group="output", gt=0, help="seconds between progress lines and metrics records")

    @model_validator(mode="after")
    def _need_keys(self):
        keys = list(self.learner_keys)
        if self.learner_key_file is not None:
            try:
                keys.append(Path(self.learner_key_file).read_text().strip())
            except OSError as exc:
                raise ValueError(f"--learner-key-file {self.learner_key_file}: {exc.strerror}") from None
        if not keys:
            raise ValueError("no --learner-key given: pass the key the learner prints at start-up (only its versions "
                             "are used), or --learner-key-file with the learner's RUN_DIR/learner.key")
        for key in keys:
            decode_learner_key(key)
        self.learner_keys = list(dict.fromkeys(keys))  # a config.yaml read back holds the file's key already
        return self

    @field_validator("pickup_delay")
    @classmethod
    def _delay(cls, spec: str) -> str:
        SecondsDelay.parse(spec)
        return spec


class TrainerConfig(TaskSettings, TrainingSettings, GenerationSettings, EvalSettings, ReportSettings):
    """The in-process trainer (`swarm demo --in-process`, the staleness study): a learner trains on
    groups generated by past versions of its own policy, staleness drawn from `delay`."""

    delay: str = setting("none", group="staleness", help="staleness in steps: none | fixed:K | uniform:K | lognormal:LO,HI,STEP_S; /drop:J drops groups older than J")
    virtual_samplers: int = setting(4, group="staleness", ge=1,
                                    help="each step's groups come from this many samplers, each with its own delay")
    eval_every: int = setting(10, group="evaluation", ge=1, help="steps between held-out evaluations")
    advantage_diagnostic_every: int = setting(
        0, group="evaluation", ge=0, help="steps between measurements of the error of the estimated expected advantage "
                                          "(swarm.diagnostics; 0: never; costs fresh samples)")

    _completion_length = model_validator(mode="after")(real_model_completion_length)

    @field_validator("delay")
    @classmethod
    def _delay(cls, spec: str) -> str:
        DelayDistribution.parse(spec)
        return spec


class BootstrapConfig(DashboardSettings):
    """`swarm bootstrap`: the node peers join through. It holds no model."""

    host: ListenHost = setting("0.0.0.0", group="swarm", help="address to listen on (0.0.0.0: every IPv4 interface)")
    port: int = setting(31337, group="swarm", ge=0, le=65535, help="TCP port to listen on (0: any free port)")
    announce_addr: Optional[str] = same_as(SwarmSettings, "announce_addr")
    transport: Literal[TRANSPORTS] = same_as(SwarmSettings, "transport")  # type: ignore[valid-type]
    insecure: bool = same_as(SwarmSettings, "insecure")
    max_runs_per_owner: int = setting(2, group="swarm", ge=1, help="gRPC registry: runs one key may take part in at once "
                                                                   "(a run's slot belongs to its learner's key)")
    peers: list[str] = setting(list, group="swarm", help="other bootstrap nodes or peers to connect to (multiaddr; repeatable)")
    run_id: str = same_as(SwarmSettings, "run_id")
    identity: Optional[Path] = setting(None, group="swarm", help="libp2p key file: keeps the peer id across restarts "
                                                                 "(unset: ~/.cache/gepo-swarm/identity/bootstrap.p2p.key)")
    run_dir: Optional[Directory] = setting(None, group="output", help="ready file and status records (unset: runs/bootstrap-TIME)")
    status_every_s: float = setting(60.0, group="output", aliases=("status_every",), gt=0,
                                    help="seconds between status lines and records")

    @model_validator(mode="after")
    def _peers_fit_transport(self):
        check_bootstrap_peers(self.transport, self.peers)
        check_insecure(self.transport, self.insecure)
        if self.announce_addr is not None:
            check_announce_addr(self.transport, self.announce_addr)
        return self


class EvalConfig(TaskSettings, EvalSettings):
    """`swarm eval`: accuracy of a policy on a task: a dataset's own test split, every row of a
    file, or the arithmetic task's test split, unless told otherwise."""

    split: Optional[Literal["all", "train", "test"]] = setting(
        None, group="evaluation", help="which problems to evaluate: all, train, or test (a dataset's own test split; a "
                                       "single file's 10% hold-out); unset: a dataset's test split, else every row, "
                                       "or the arithmetic test split")
    eval_problems: Optional[int] = setting(None, group="evaluation", aliases=("limit",), ge=1,
                                           help="evaluate only the split's first N problems (unset: every one)")
    temperature: float = same_as(GenerationSettings, "temperature")
    max_completion_length: int = same_as(GenerationSettings, "max_completion_length")
    greedy: bool = setting(True, group="evaluation", help="also measure temperature-0 accuracy")
    pass_at_k: list[int] = setting(list, group="evaluation",
                                   help="also report pass@k for this k (repeatable; at most --eval-samples): the unbiased "
                                        "estimate over each problem's samples (Chen et al. 2021)")
    show: int = setting(0, group="evaluation", ge=0, help="print this many sampled completions with their rewards")
    backend: Literal[GENERATION_BACKENDS] = same_as(SamplerConfig, "backend")  # type: ignore[valid-type]
    device: str = same_as(SamplerConfig, "device")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = same_as(SamplerConfig, "dtype")
    seed: int = same_as(TrainingSettings, "seed")
    lora_r: int = same_as(
        LoraSettings, "lora_r",
        help="the rank of the LoRA run whose checkpoint --model is (RUN_DIR/checkpoints/version-N: its adapter over the base "
             "its adapter_config.json names), checked against the checkpoint's own; a fresh adapter is the base model "
             "itself, so any other --model is refused (0: no check, any model)")

    _completion_length = model_validator(mode="after")(real_model_completion_length)

    @model_validator(mode="after")
    def _k_within_samples(self):
        for k in self.pass_at_k:
            if not 1 <= k <= self.eval_samples:
                raise ValueError(f"--pass-at-k {k} needs 1 <= k <= --eval-samples ({self.eval_samples}): pass "
                                 f"--eval-samples {max(k, 1)} or more")
        return self


class DemoConfig(TrainerConfig):
    """`swarm demo`: a whole local swarm (bootstrap, learner, samplers as processes) on this machine,
    or with `in_process` the in-process trainer; accuracy before and after."""

    samplers: int = setting(2, group="swarm", ge=1, le=16, help="sampler processes")
    transport: Literal[TRANSPORTS] = same_as(SwarmSettings, "transport")  # type: ignore[valid-type]
    prompts_per_round: int = same_as(SamplerConfig, "prompts_per_round")
    pickup_delay: str = same_as(SamplerConfig, "pickup_delay")
    in_process: bool = setting(False, group="staleness", help="train in this one process instead (no network; --delay "
                                                              "simulates staleness)")
    run_dir: Optional[Directory] = setting(None, group="output", help="where logs, checkpoints and the plot go (unset: runs/demo-TIME)")

    _delay_of_pickup = field_validator("pickup_delay")(SamplerConfig._delay.__func__)

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(**self.model_dump(include=set(TrainerConfig.model_fields)))


for _model in (LossConfig, SwarmSettings, TaskSettings, TrainingSettings, GenerationSettings, EvalSettings,
               LearnerConfig, SamplerConfig, TrainerConfig, BootstrapConfig, EvalConfig, DemoConfig):
    aliased(_model)

CONFIGS: dict[str, type[Settings]] = {"learner": LearnerConfig, "sampler": SamplerConfig, "bootstrap": BootstrapConfig,
                                      "demo": DemoConfig, "eval": EvalConfig}
