"""The groups of settings that several roles share, the loss config, and what a transport accepts
as peer addresses. Every default of these settings is written here, once."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal, Optional, Sequence

from pydantic import AfterValidator, field_validator, model_validator

from swarm.config.base import Settings, setting
from swarm.reporting import check_report_to
from swarm.rewards import resolve_reward  # stdlib only at import: math-verify loads when a reward runs

TRANSPORTS = ("hivemind", "grpc")  # swarm.fabric.transports implements exactly these
GENERATION_BACKENDS = ("transformers", "vllm")  # swarm.generation.make_backend builds exactly these
# The registered policy losses (swarm/losses registers exactly these; a test checks it). Listed here
# so that option choices and config validation need no torch import.
REPORT_SINKS = ("none", "jsonl", "tensorboard", "wandb")  # swarm/reporting.py writes exactly these
LOSS_NAMES = ("gepo", "grpo", "dr_grpo", "bnpo", "gspo", "gmpo", "topr", "cispo", "m2po", "decoupled_ppo",
              "tis_mis", "opsm")


def check_listen_host(host: str) -> str:
    """A host to listen on must be an IP address literal (the swarm's addresses are built from it)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address to listen on; use one of this machine's addresses, "
                         "0.0.0.0 (every IPv4 interface) or 127.0.0.1") from None
    return host


def check_directory(path: Path) -> Path:
    """A directory a peer will write to must not be an existing file."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file, not a directory; choose a directory (it is made if missing)")
    return path


ListenHost = Annotated[str, AfterValidator(check_listen_host)]
Directory = Annotated[Path, AfterValidator(check_directory)]


def check_peers(transport: str, peers: Sequence[str]) -> None:
    """Raise ValueError, saying what to pass instead, when `peers` do not fit `transport`."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of: {', '.join(TRANSPORTS)}")
    for addr in peers:
        if transport == "hivemind" and not str(addr).startswith("/"):
            raise ValueError(f"--peers {addr!r} is not a multiaddr; pass one like /ip4/1.2.3.4/tcp/31337/p2p/Qm... "
                             "(or use --transport grpc with the registry's HOST:PORT)")
        if transport == "grpc" and (str(addr).startswith("/") or ":" not in str(addr)):
            raise ValueError(f"--peers {addr!r}: with --transport grpc pass the registry's HOST:PORT (KEYID@HOST:PORT pins its TLS key), "
                             "as `swarm bootstrap --transport grpc` prints it")
    if transport == "grpc" and len(peers) != 1:
        raise ValueError("with --transport grpc pass exactly one --peers HOST:PORT (the registry)")


def check_announce_addr(transport: str, addr: str) -> str:
    """An announced address: HOST or HOST:PORT with an IP literal host (over hivemind also a multiaddr)."""
    if transport == "hivemind" and addr.startswith("/"):
        if "/tcp/" not in addr and "/udp/" not in addr:
            raise ValueError(f"--announce-addr {addr!r} names no port; pass e.g. /ip4/203.0.113.7/tcp/31337")
        return addr
    host, port = split_host_port(addr)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"--announce-addr {addr!r}: {host!r} is not an IP address; pass the address other peers dial, "
                         "e.g. 203.0.113.7 or 203.0.113.7:31337") from None
    if ipaddress.ip_address(host).is_unspecified:
        raise ValueError(f"--announce-addr {addr!r} is a wildcard, which no peer can dial; pass this machine's address")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"--announce-addr {addr!r}: the port must be 1..65535")
    return addr


def split_host_port(addr: str) -> tuple[str, int | None]:
    """("1.2.3.4", 31337) from "1.2.3.4:31337", ("1.2.3.4", None) from "1.2.3.4"; IPv6 as [::1]:31337."""
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    elif addr.count(":") == 1:
        host, _, port = addr.partition(":")
    else:
        host, port = addr, None
    try:
        return host, int(port) if port else None
    except ValueError:
        raise ValueError(f"address {addr!r}: {port!r} is not a port number") from None


def check_insecure(transport: str, insecure: bool) -> None:
    """--insecure is the gRPC transport's: libp2p encrypts its streams itself, always."""
    if insecure and transport != "grpc":
        raise ValueError("--insecure turns off the gRPC transport's TLS; libp2p (--transport hivemind) always encrypts: "
                         "drop --insecure, or use --transport grpc")


def check_bootstrap_peers(transport: str, peers: Sequence[str]) -> None:
    """What a bootstrap node may join: other hivemind nodes; a gRPC registry joins nothing."""
    if transport == "grpc":
        if peers:
            raise ValueError("a gRPC registry joins no other peers; drop --peers (or use --transport hivemind)")
        return
    check_peers(transport, peers)


# ---------------------------------------------------------------------------------------------
# The policy loss


class LossConfig(Settings):
    """Which policy loss to use and its knobs. The default, TOPR in its paper's form, is the staleness
    study's answer (docs/staleness.md, "Which loss to use"): the only loss within 3% of its online accuracy at
    staleness 64 and 256, and within a seed's spread of the best at 0 and 8; GEPO is `name="gepo"`. Unset clip
    bounds take the loss's own defaults
    (its paper's: GRPO/GEPO 0.2, GSPO 3e-4 / 4e-4, GMPO 0.4 in log space, CISPO none / 3, i.e. the
    weight capped at ScaleRL's 4; M2PO and TOPR clip nothing). The fields after `max_completion_length`
    belong to one loss each and are ignored by the others."""

    name: Literal[LOSS_NAMES] = setting("topr", group="loss", help="the policy loss (topr: the staleness study's answer; gepo: "
                                                          "the paper's GEPO, with --gepo-clip)")  # type: ignore[valid-type]
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
    max_claimed_log_ratio: float = setting(
        2.0, group="loss", gt=0,
        help="how far (nats per token) a sampler's claimed log-prob q is taken from the learner's p: the k3 penalty's "
             "log(q / p) is clamped to +/- this, and importance weights use q no smaller than p * e^-this. Samplers' claims "
             "are checked for a fraction of groups only, and an unchecked claim of q = 1 on a token the policy gives e^-10 "
             "would otherwise weigh e^10 times an honest token's (issue 45); honest tokens so far apart are rare")
    seq_logprob_mode: Literal["mean", "sum"] = setting(
        "mean", group="loss", help="sequence log-prob for sequence- and group-level weights: mean over tokens "
                                    "(the GEPO reference) or sum")
    gepo_expectation: Literal["group", "batch"] = setting(
        "group", group="loss", help="GEPO's E_q[q] over each prompt's group (the paper) or over the whole micro-batch "
                                     "(what the reference code does; for comparison only)")
    gepo_clip: Literal["weight", "ratio", "weight+token", "weight+token-neg"] = setting(
        "weight+token-neg", group="loss",
        help="GEPO: weight+token-neg (default): the PPO clip acts on the weight p / E_q[q] and also drops the gradient "
             "of each negative-advantage token whose own ratio p_t / q_t is below 1 - epsilon, which fixes GEPO's drift "
             "at staleness 8 (benchmarks/gepo_weak_spot.py); weight: the clip on the weight alone (the paper); "
             "weight+token: the token clip on every token; ratio: the clip on the sequence's own ratio p / q, the "
             "weight still scaling the gradient")
    max_completion_length: Optional[int] = setting(
        None, group="loss", gt=0, help="Dr.GRPO's constant normaliser: the samplers' max_completion_length "
                                        "(unset: the batch's padded width)")
    topr_form: Literal["paper", "normalised"] = setting(
        "paper", group="loss", help="TOPR: 'paper' (Le Roux et al.: truncation weight min(1, pi(y)/mu(y)) from the "
                                    "whole-sequence ratio, token log-probs summed per sequence) or 'normalised' "
                                    "(the registry's earlier form: weight from seq_logprob_mode, token log-probs averaged "
                                    "per sequence)")
    m2po_threshold: float = setting(
        0.04, group="loss", gt=0, help="M2PO: the second-moment budget tau_M2 on mean (log ratio)^2 of the trust-region "
                                       "tokens (0.04 in all of the M2PO paper's runs)")
    behaviour_weight_cap: float = setting(
        5.0, group="loss", gt=1, help="decoupled_ppo: tokens whose behaviour weight pi_prox/pi_behaviour exceeds this are "
                                      "left out (AReaL's default cap, 5)")
    tis_cap: float = setting(
        2.0, group="loss", gt=0, help="tis_mis: token weights min(pi/mu, C) with this C (Yao et al.'s TIS and verl's presets: 2)")
    mis_low: float = setting(
        0.5, group="loss", ge=0, help="tis_mis: sequences whose whole-sequence ratio pi(y)/mu(y) is below this are masked "
                                      "(verl's Seq-MIS preset: 0.5)")
    mis_high: float = setting(
        2.0, group="loss", gt=0, help="tis_mis: sequences whose whole-sequence ratio is above this are masked (verl: 2)")
    opsm_delta: float = setting(
        1e-4, group="loss", ge=0, help="opsm: negative-advantage sequences whose mean token log(mu/pi) exceeds this are "
                                       "masked. DeepSeek-V3.2 publishes no value; 1e-4 is slime's default, TRL suggests 0.5")

    @model_validator(mode="after")
    def _mis_bounds_ordered(self):
        if self.mis_low >= self.mis_high:
            raise ValueError(f"mis_low {self.mis_low} must be below mis_high {self.mis_high}: sequences with a ratio "
                             "outside [mis_low, mis_high] are masked, so this range would mask every sequence")
        return self


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
    identity_dir: Optional[Directory] = setting(None, group="swarm",
                                           help="where this peer's keys live (unset: ~/.cache/gepo-swarm/identity)")
    host: ListenHost = setting("0.0.0.0", group="swarm", help="address to listen on (0.0.0.0: every IPv4 interface, so peers on "
                                                       "other machines can reach this one; 127.0.0.1: this machine only)")
    port: int = setting(0, group="swarm", ge=0, le=65535, help="TCP port to listen on (0: any free port)")
    announce_addr: Optional[str] = setting(
        None, group="swarm",
        help="the address other peers dial to reach this one, when it is not the one it listens on: HOST or HOST:PORT "
             "(a public IP with a forwarded port, or the one of several addresses that others can reach; over hivemind "
             "also a multiaddr). Unset: over hivemind the addresses of this machine's interfaces, over gRPC the address "
             "the registry sees this peer connect from")
    auto_relay: bool = setting(
        False, group="swarm", help="hivemind, experimental: behind a NAT that nobody can dial, reserve a slot on a relay "
                                   "(the bootstrap nodes) and be reached through it; all that traffic then passes the "
                                   "relay. Slow to start and not tested here (docs/fabric.md, 'Behind a NAT')")
    client_mode: bool = setting(
        False, group="swarm", help="hivemind: take no part in storing DHT records (for a peer that others cannot dial: "
                                   "they would try it for every lookup); it still reads and writes records")
    heartbeat_s: float = setting(5.0, group="swarm", gt=0, help="seconds between membership heartbeats")
    insecure: bool = setting(
        False, group="swarm", help="gRPC: talk in plain text, without TLS (a warning is logged): anyone on the path can read "
                                   "and rewrite what peers send. Every peer and the registry of a swarm must agree. Unset: "
                                   "TLS, each peer's certificate pinned by the key id in its peer id (KEYID@HOST:PORT)")
    upload_slots: int = setting(2, group="swarm", ge=0, help="weight transfers this peer serves at once: the learner's "
                                                             "upload budget, a sampler's share of relaying versions "
                                                             "(others ask another holder meanwhile; a chunk under "
                                                             "1 MiB takes that share of one); 0: no limit")

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
        if self.announce_addr is not None:
            check_announce_addr(self.transport, self.announce_addr)
        check_insecure(self.transport, self.insecure)
        if self.transport == "grpc" and (self.auto_relay or self.client_mode):
            raise ValueError("--auto-relay and --client-mode are hivemind (libp2p) options; over gRPC a peer behind a "
                             "NAT dials out and needs neither (see docs/fabric.md, 'Behind a NAT')")
        return self


class TaskSettings(Settings):
    """Which policy and task (every peer of a run must use the same)."""

    model: str = setting("embedded", group="task", help="policy: 'embedded', a model directory or a hub id")
    task: str = setting("arithmetic", group="task", help="'arithmetic', a local jsonl/json/parquet/csv file, a directory "
                                                         "of them named by split (train.jsonl, test.jsonl) or a dataset id")
    difficulty: int = setting(2, group="task", ge=1, le=4, help="arithmetic task difficulty")
    dataset_config: Optional[str] = setting(None, group="task", help="dataset tasks: the hub dataset's configuration "
                                                                     "(GSM8K: main)")
    question_column: str = setting("question", group="task", help="dataset tasks: the question column")
    answer_column: str = setting("answer", group="task", help="dataset tasks: the answer column")
    answer_pattern: Optional[str] = setting(
        None, group="task", help="dataset tasks: a regex that finds the gold answer in the answer column: its first group, "
                                 "or the whole match (GSM8K: '####\\s*(.+)'); rows it does not match are left out")
    prompt_template: str = setting("{question}\nPut the final answer in \\boxed{}.", group="task",
                                   help="dataset tasks: the prompt, with {question} where the question goes")
    system_prompt: Optional[str] = setting(None, group="task", help="dataset tasks: a system message before the prompt")
    apply_chat_template: bool = setting(True, group="task", help="dataset tasks: wrap prompts in the tokenizer's chat "
                                                                 "template when it has one (--no-apply-chat-template: plain text)")
    max_prompt_length: Optional[int] = setting(
        None, group="task", ge=1, help="cut longer prompts to their last this many tokens, as TRL does (from the left; "
                                       "unset: no limit). Every peer of a run must use the same")
    reward_funcs: list[str] = setting(
        lambda: ["accuracy"], group="task",
        help="the rewards summed into each completion's score (repeatable): accuracy (math-verify against the gold answer), "
             "format (ends in one \\boxed{}), or a dotted path 'pkg.module:function' taking (completion, answer). "
             "Every peer of a run must use the same: the learner rescores each group and refuses other rewards")
    reward_weights: list[float] = setting(
        list, group="task", help="one weight per --reward-funcs, in their order (repeatable; unset: 1 each)")
    stop_strings: list[str] = setting(list, group="task", aliases=("stop",),
                                      help="a completion ends at the first of these (repeatable); what follows is not scored")

    @field_validator("answer_pattern")
    @classmethod
    def _pattern_compiles(cls, pattern: Optional[str]) -> Optional[str]:
        import re

        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression ({exc}); GSM8K's is '####\\s*(.+)'") from None
        return pattern

    @field_validator("prompt_template")
    @classmethod
    def _template_has_question(cls, template: str) -> str:
        if "{question}" not in template:
            raise ValueError(f"{template!r} has no {{question}}: write {{question}} where the question goes")
        return template

    @field_validator("stop_strings")
    @classmethod
    def _no_empty_stop(cls, stops: list[str]) -> list[str]:
        if any(not s for s in stops):
            raise ValueError("an empty stop string would end every completion at once; drop it")
        return stops

    @field_validator("reward_funcs")
    @classmethod
    def _rewards_resolve(cls, names: list[str]) -> list[str]:
        for name in names:
            resolve_reward(name)  # an unknown name or a dotted path that does not import: said now, not mid-run
        return names

    @model_validator(mode="after")
    def _a_weight_per_reward(self):
        if not self.reward_funcs:
            raise ValueError("--reward-funcs: at least one reward is needed, e.g. accuracy")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"--reward-weights: {len(self.reward_weights)} weight(s) for {len(self.reward_funcs)} "
                             f"--reward-funcs ({', '.join(self.reward_funcs)}); give one weight per reward, in order")
        return self

    def reward_spec(self) -> list[tuple[str, float]]:
        """(reward, weight) pairs, as swarm.rewards.RewardScorer takes them."""
        return list(zip(self.reward_funcs, self.reward_weights or [1.0] * len(self.reward_funcs)))

    @model_validator(mode="after")
    def _options_fit_the_task(self):
        """An option the task ignores is a mistake to report, not to drop silently."""
        dataset_only = ("dataset_config", "question_column", "answer_column", "answer_pattern", "prompt_template",
                        "system_prompt", "apply_chat_template")
        given = [name for name in dataset_only if getattr(self, name) != TaskSettings.model_fields[name].default]
        if self.task == "arithmetic" and given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies to dataset tasks, not the built-in arithmetic task; "
                             "drop it, or pass --task FILE or a dataset id")
        if self.task != "arithmetic" and self.difficulty != TaskSettings.model_fields["difficulty"].default:
            raise ValueError("--difficulty applies to the built-in arithmetic task only; drop it")
        return self

    def task_options(self) -> dict:
        """What `swarm.tasks.load_task` takes for this task: every peer's prompts, answers and stop strings."""
        if self.task == "arithmetic":
            return {"difficulty": self.difficulty, "stop_strings": list(self.stop_strings),
                    "max_prompt_length": self.max_prompt_length}
        return {name: getattr(self, name) for name in ("dataset_config", "question_column", "answer_column", "answer_pattern",
                                                       "prompt_template", "system_prompt", "apply_chat_template",
                                                       "stop_strings", "max_prompt_length")}


class ReportSettings(Settings):
    """Where a peer's metrics go besides its JSONL files (swarm/reporting.py)."""

    report_to: list[Literal[REPORT_SINKS]] = setting(  # type: ignore[valid-type]
        lambda: ["jsonl"], group="output",
        help="also write the metrics, under their JSONL names, to tensorboard (RUN_DIR/tensorboard) and/or wandb "
             "(offline unless WANDB_API_KEY is set); repeatable. The JSONL files are always written")

    @field_validator("report_to")
    @classmethod
    def _sinks_installed(cls, sinks: list[str]) -> list[str]:
        return check_report_to(sinks)


class DashboardSettings(Settings):
    """The live dashboard a peer may serve itself (swarm/dashboard/): the page `swarm dashboard` serves."""

    dashboard_port: Optional[int] = setting(
        None, group="output", ge=0, le=65535,
        help="serve the live dashboard of the swarm (the page `swarm dashboard` serves, with this peer's run directory) "
             "from this peer on this port (0: a free one; its URL is printed and written to ready.json); unset: none")
    dashboard_host: ListenHost = setting(
        "127.0.0.1", group="output",
        help="address the dashboard listens on (the default, loopback, keeps it to this machine and answers only requests "
             "to localhost: reach it from elsewhere through an SSH tunnel)")
    dashboard_poll_s: float = setting(1.5, group="output", ge=0.2, help="seconds between the dashboard's readings of the swarm")


LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # Qwen/Llama's linears


class LoraSettings(Settings):
    """LoRA runs (swarm/lora.py): the base model frozen, pinned by its hash in the run's signed
    announcements, and a version is the adapter alone (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
    Large Language Models"): W x + (alpha / r) B A x, A (r, in), B (out, r), B starting at zero."""

    lora_r: int = setting(0, group="lora", ge=0, help="LoRA rank r: train a rank-r adapter on the frozen base model, and "
                                                       "publish only the adapter as a version (0: off, every weight trains)")
    lora_alpha: float = setting(16.0, group="lora", gt=0, help="LoRA alpha: the adapter's update is scaled by alpha / r")
    lora_dropout: float = setting(0.0, group="lora", ge=0, lt=1, help="dropout on the adapter's input while training (0: "
                                                                       "none; samplers never apply it)")
    lora_target_modules: list[str] = setting(
        lambda: list(LORA_TARGET_MODULES), group="lora",
        help="the linear layers that get an adapter, by the last part of their name (repeatable; the default: every "
             "attention and MLP projection of a Qwen or Llama model)")
    lora_learning_rate: float = setting(
        2e-3, group="lora", gt=0,
        help="AdamW learning rate of a LoRA run, used in place of --learning-rate: an adapter, starting at zero and "
             "scaled by alpha / r, needs a larger one than full fine-tuning (the embedded demo: 2e-3 against 1e-4)")

    @field_validator("lora_target_modules")
    @classmethod
    def _targets_named(cls, names: list[str]) -> list[str]:
        if not names or any(not n or not n.replace("_", "").replace(".", "").isalnum() for n in names):
            raise ValueError(f"--lora-target-modules {names}: give one or more module names such as q_proj and v_proj "
                             "(letters, digits, _ and .)")
        return list(dict.fromkeys(names))

    @property
    def lora(self) -> bool:
        return self.lora_r > 0


class TrainingSettings(LoraSettings):
    """What the learner and the in-process trainer share: loss, optimizer, schedule, batch, LoRA."""

    loss: LossConfig = setting(LossConfig, group="loss", help="the policy loss and its knobs")
    learning_rate: float = setting(1e-4, group="optimizer", aliases=("lr",), gt=0, help="AdamW learning rate")
    lr_warmup_steps: int = setting(5, group="optimizer", ge=0,
                                   help="linear learning-rate warm-up over the first versions (damps Adam's sign-like first steps)")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = setting(
        "constant", group="optimizer",
        help="learning rate after the warm-up, by version (transformers' get_scheduler): constant, or a linear or "
             "cosine decay to 0 at --steps")
    max_grad_norm: float = setting(1.0, group="optimizer", ge=0, help="gradient clipping by global norm (0: off)")
    weight_decay: float = setting(0.0, group="optimizer", ge=0, help="AdamW weight decay")
    adam_beta1: float = setting(0.9, group="optimizer", ge=0, lt=1, help="AdamW beta1")
    adam_beta2: float = setting(0.99, group="optimizer", ge=0, lt=1,
                                help="AdamW beta2 (0.99 rather than torch's 0.999: RL steps are few and noisy)")
    adam_epsilon: float = setting(1e-8, group="optimizer", gt=0, help="AdamW epsilon")
    micro_batch_groups: int = setting(16, group="training", ge=1,
                                      help="groups per forward/backward; gradients accumulate over micro-batches (a group "
                                           "is never split: GEPO's expectation is over a whole group)")
    micro_batch_tokens: Optional[int] = setting(
        None, group="training", ge=1, help="also cap a micro-batch at this many padded tokens (prompt + completion, summed "
                                           "over its sequences); a group larger than the cap goes alone")
    logprob_chunk: int = setting(2048, group="training", ge=0,
                                 help="completion tokens whose vocabulary logits are computed at once (and again in "
                                      "backward), so float32 (batch, length, vocab) logits never exist whole; 0: all at once")
    gradient_checkpointing: bool = setting(False, group="training", help="recompute activations in backward (less memory, "
                                                                         "about a third more compute)")
    torch_compile: Literal["off", "head", "all"] = setting(
        "off", group="training",
        help="torch.compile on the learner: head (the log-prob head's full-vocabulary passes, each fused into one "
             "kernel) or all (that and every decoder layer: norms, rotary, activation and casts fused between the "
             "matmuls); compiling takes tens of seconds at the first step and again at new lengths. For GPUs, where "
             "those passes are memory-bound; off: eager (benchmarks.gpu_check measures each)")
    optimizer_implementation: Literal["auto", "fused", "foreach", "for_loop"] = setting(
        "auto", group="optimizer",
        help="AdamW's kernels: fused (one kernel per step over all parameters), foreach (a few per parameter group) or "
             "for_loop (several per parameter); auto: fused on CUDA, torch's own choice elsewhere (the same update up to "
             "float rounding)")
    steps: int = setting(60, group="training", ge=1, help="stop when the policy reaches this version")
    groups_per_step: int = setting(
        32, group="training", aliases=("prompts_per_step",), ge=1,
        help="rollout groups (prompts, each with its num_generations completions) per optimizer step (the swarm "
             "learner steps on fewer when --wait-s passes without them); counted in groups, not completions as TRL's "
             "batch size is, since GEPO's expectation needs whole groups")
    max_staleness: int = setting(64, group="training", ge=0,
                                 help="groups more than this many versions behind are dropped (the paper's runs: 64)")
    seed: int = setting(0, group="training", help="random seed: torch's in the learner; the in-process trainer's prompt order "
                                                  "and sampling; the evaluation's sampling")

    @property
    def effective_learning_rate(self) -> float:
        """The learning rate the optimizer starts from: --lora-learning-rate in a LoRA run, else --learning-rate."""
        return self.lora_learning_rate if self.lora_r > 0 else self.learning_rate

    @model_validator(mode="after")
    def _one_learning_rate(self):
        default = TrainingSettings.model_fields["learning_rate"].default
        if self.lora_r > 0 and "learning_rate" in self.model_fields_set and self.learning_rate != default:
            raise ValueError(f"--learning-rate {self.learning_rate:g} with --lora-r {self.lora_r}: a LoRA run trains at "
                             "--lora-learning-rate; pass that instead")
        return self

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
    temperature: float = setting(1.0, group="generation", gt=0, le=100, help="sampling temperature")
    top_k: int = setting(0, group="generation", ge=0, help="sample from the k most likely tokens only (0: all)")
    top_p: float = setting(1.0, group="generation", gt=0, le=1, help="nucleus sampling: the smallest set of tokens "
                                                                        "holding this much probability (1: all)")


class DeviceSettings(Settings):
    """Where a peer runs its policy, and in which precision (swarm.model.device resolves "auto")."""

    device: str = setting("auto", group="device", help="torch device: auto (CUDA when present), cpu, cuda, cuda:1, ...")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", group="device", help="precision of the policy: auto is bfloat16 on a GPU, float32 on a CPU")


class EvalSettings(Settings):
    """Held-out evaluation (the trainer's and the demo's; `swarm eval` takes its defaults from here)."""

    eval_problems: int = setting(200, group="evaluation", aliases=("limit",), ge=1, help="held-out problems per evaluation")
    eval_samples: int = setting(4, group="evaluation", aliases=("samples",), ge=1, help="samples per problem for pass@1")
