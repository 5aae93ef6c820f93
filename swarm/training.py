"""The learner's optimisation step on a list of rollout groups: learning-rate schedule, advantages,
the chosen policy loss, gradient clipping, optimizer step, version bump, and the step's metrics (the
schema of steps.jsonl). No I/O: the swarm learner and the in-process trainer both call it.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Sequence

import torch

from swarm.advantages import group_advantages
from swarm.logprobs import completion_logprobs
from swarm.config import LossConfig, TrainingSettings, default_of
from swarm.losses import LOSSES, LossInputs, compute_loss
from swarm.losses.base import BatchTotals, batch_totals
from swarm.losses.step_diagnostics import StepDiagnostics
from swarm.lora import trainable_parameters
from swarm.rollouts import RolloutGroup, collate

STALENESS_BINS = (0, 1, 2, 4, 8, 16, 32, 64)  # histogram bucket lower edges, in steps


class OutOfStep(RuntimeError):
    """Another learner of the run holds a newer or different state: this one must download it
    before it steps again (nothing was changed). `at_least`: the oldest version worth downloading
    (0: any as new as this learner's own)."""

    def __init__(self, reason: str, at_least: int = 0) -> None:
        super().__init__(reason)
        self.at_least = at_least


class NothingToStep(RuntimeError):
    """No rollouts here and no gradient from the other learners: no step was taken."""


class NonFiniteStep(RuntimeError):
    """The step's loss or gradient norm was not finite; the policy and optimizer were left unchanged."""

    def __init__(self, message: str, metrics: dict) -> None:
        super().__init__(message)
        self.metrics = metrics


def warmup_factor(version: int, warmup_steps: int) -> float:
    """Linear warm-up by policy version: the step from version v uses (v + 1) / warmup_steps of the
    learning rate. By version rather than by a scheduler's own counter, so that a resumed learner
    continues the schedule where it stopped."""
    return min(1.0, (version + 1) / warmup_steps) if warmup_steps else 1.0


# --lr-scheduler-type: TRL's names, each transformers' own schedule of that name (get_scheduler)
SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def lr_schedule(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The learning-rate factor of the step from each version: transformers' `get_scheduler` schedule
    of `kind` (constant, linear or cosine decay to 0 at `total_steps`) after our warm-up. A pure
    function of the version, as warmup_factor, so a resumed learner needs no scheduler state.
    Departure from transformers: during warm-up the step from version v uses (v + 1) / warmup_steps,
    not v / warmup_steps, so that the first step is not wasted at learning rate 0."""
    from transformers import get_scheduler

    if kind not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {kind!r}; choose one of: {', '.join(SCHEDULES)}")
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # get_scheduler wants an optimizer
    scheduler = get_scheduler(SCHEDULES[kind], dummy, num_warmup_steps=warmup_steps, num_training_steps=max(total_steps, 1))
    after_warmup = scheduler.lr_lambdas[0]

    def factor(version: int) -> float:
        return warmup_factor(version, warmup_steps) if version < warmup_steps else max(0.0, float(after_warmup(version)))

    return factor


def staleness_histogram(staleness: list[int]) -> dict[str, int]:
    edges = list(STALENESS_BINS) + [None]
    hist = {}
    for low, high in zip(edges[:-1], edges[1:]):
        label = f"{low}" if high == low + 1 else (f"{low}-{high - 1}" if high else f"{low}+")
        hist[label] = sum(1 for s in staleness if s >= low and (high is None or s < high))
    return hist


def plan_micro_batches(groups: Sequence[RolloutGroup], max_groups: int, max_tokens: int | None) -> list[list[RolloutGroup]]:
    """Consecutive groups, whole, into micro-batches of at most `max_groups` groups and (when set)
    `max_tokens` padded tokens: rows x (longest prompt + longest completion) of the micro-batch, the
    size of its padded tensors. A group larger than `max_tokens` goes alone."""
    batches: list[list[RolloutGroup]] = []
    current: list[RolloutGroup] = []
    rows = prompt = completion = 0
    for g in groups:
        g_prompt, g_completion = len(g.prompt_ids), max((len(c) for c in g.completion_ids), default=0)
        grown = (rows + g.size) * (max(prompt, g_prompt) + max(completion, g_completion))
        if current and (len(current) >= max_groups or (max_tokens is not None and grown > max_tokens)):
            batches.append(current)
            current, rows, prompt, completion = [], 0, 0, 0
        current.append(g)
        rows, prompt, completion = rows + g.size, max(prompt, g_prompt), max(completion, g_completion)
    if current:
        batches.append(current)
    return batches


def totals_of(groups: Sequence[RolloutGroup]) -> BatchTotals:
    lengths = [len(c) for g in groups for c in g.completion_ids]
    return BatchTotals(sequences=sum(n > 0 for n in lengths), tokens=sum(lengths), rows=len(lengths),
                       width=max(max(lengths, default=0), 1))


def make_adamw(params: list[torch.nn.Parameter], implementation: str, **kwargs) -> torch.optim.AdamW:
    """AdamW over `params` with the kernels of `implementation` (TrainingSettings.optimizer_implementation):
    "auto" takes the fused kernel on CUDA (one launch for every parameter's update, where foreach, torch's
    default there, makes several per parameter group) and torch's own choice elsewhere."""
    if implementation == "auto":
        implementation = "fused" if params and all(p.device.type == "cuda" for p in params) else "default"
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}, "default": {}}
    if implementation not in flags:
        raise ValueError(f"unknown optimizer implementation {implementation!r}; choose one of: auto, fused, foreach, for_loop")
    return torch.optim.AdamW(params, **kwargs, **flags[implementation])


def compile_decoder_layers(model) -> int:
    """torch.compile on each decoder layer of `model` (regional compilation: the layers share one
    compiled graph, so compiling costs one layer's time, not the model's), so that the norms, rotary
    embedding, activation and casts between the matmuls run as a few fused kernels. Returns the
    number of layers compiled; a model without a `layers` list is refused, saying so."""
    if hasattr(model, "get_base_model"):  # a LoRA run's PEFT wrapper
        model = model.get_base_model()
    decoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"--torch-compile all compiles each decoder layer, and {type(model).__name__} has no decoder "
                         "layer list (model.<base_model_prefix>.layers); use --torch-compile head or off")
    for layer in layers:
        layer.compile()
    return len(layers)


# Metrics that are the micro-batch's part of the whole batch's value inside `batch_totals` (they
# add up); the rest are means over the micro-batch, weighted by its share of sequences.
ADDITIVE_METRICS = ("loss", "policy_loss", "kl_penalty")


def _on_host(parts: list[tuple[dict[str, torch.Tensor], float, torch.Tensor, torch.Tensor]], device: torch.device) -> list:
    """The micro-batches' (metrics, share, fresh gap, fresh tokens) with every tensor read back to the
    host in one transfer (floats, as `float(tensor)` gives them)."""
    scalars = [torch.as_tensor(v, device=device).detach().reshape(()).float()
               for metrics, _, gap, fresh in parts for v in (*metrics.values(), gap, fresh)]
    values = iter(torch.stack(scalars).tolist() if scalars else [])
    return [({k: next(values) for k in metrics}, share, next(values), next(values)) for metrics, share, _, _ in parts]


class LearnerCore:
    """Owns the trainable policy and its optimizer; `version` counts optimizer steps.

    learning_rate: AdamW learning rate, warmed up over `lr_warmup_steps` versions, then scheduled by
    `lr_scheduler_type` (constant, linear, cosine) to reach its end at version `total_steps`.
    max_grad_norm: gradient clipping (<= 0 disables).
    micro_batch_groups / micro_batch_tokens: groups and padded tokens per forward/backward;
    gradients accumulate across micro-batches, and the step is the one-batch step up to float
    rounding (a group is never split, since GEPO's expectation is taken over a whole group).
    logprob_chunk: completion positions whose logits exist at once (swarm.logprobs; 0: all).
    autocast_dtype: run forward and backward under torch.autocast in this dtype (bfloat16), the
    parameters and optimizer state staying in their own (float32 master weights); None: off.
    advantage_mode: None takes the loss's own (std for GRPO/GEPO, no_std for Dr.GRPO, beta for BNPO).
    torch_compile: "head" compiles the log-prob head's full-vocabulary passes, "all" also each decoder
    layer (compile_decoder_layers); "off": eager. optimizer_implementation: AdamW's kernels (make_adamw).
    """

    def __init__(
        self,
        model,
        pad_token_id: int,
        *,
        loss: LossConfig | None = None,
        learning_rate: float = default_of(TrainingSettings, "learning_rate"),
        lr_warmup_steps: int = default_of(TrainingSettings, "lr_warmup_steps"),
        lr_scheduler_type: str = default_of(TrainingSettings, "lr_scheduler_type"),
        total_steps: int = default_of(TrainingSettings, "steps"),
        weight_decay: float = default_of(TrainingSettings, "weight_decay"),
        betas: tuple[float, float] = (default_of(TrainingSettings, "adam_beta1"), default_of(TrainingSettings, "adam_beta2")),
        adam_epsilon: float = default_of(TrainingSettings, "adam_epsilon"),
        max_grad_norm: float = default_of(TrainingSettings, "max_grad_norm"),
        micro_batch_groups: int = default_of(TrainingSettings, "micro_batch_groups"),
        micro_batch_tokens: int | None = default_of(TrainingSettings, "micro_batch_tokens"),
        logprob_chunk: int = default_of(TrainingSettings, "logprob_chunk"),
        gradient_checkpointing: bool = default_of(TrainingSettings, "gradient_checkpointing"),
        torch_compile: str = default_of(TrainingSettings, "torch_compile"),
        optimizer_implementation: str = default_of(TrainingSettings, "optimizer_implementation"),
        autocast_dtype: torch.dtype | None = None,
        advantage_mode: str | None = None,
        version: int = 0,
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.loss = loss or LossConfig()
        self.advantage_mode = advantage_mode or LOSSES[self.loss.name].advantage_mode
        self.max_grad_norm = max_grad_norm
        self.micro_batch_groups, self.micro_batch_tokens, self.logprob_chunk = micro_batch_groups, micro_batch_tokens, logprob_chunk
        self.autocast_dtype = autocast_dtype
        self.learning_rate, self.lr_warmup_steps = learning_rate, lr_warmup_steps
        self.lr_factor = lr_schedule(lr_scheduler_type, lr_warmup_steps, total_steps)  # of the version: resumes need no state
        if gradient_checkpointing:  # activations are recomputed in backward (renamed in transformers 5)
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if torch_compile not in ("off", "head", "all"):
            raise ValueError(f"unknown torch_compile {torch_compile!r}; choose one of: off, head, all")
        self.torch_compile = torch_compile
        if torch_compile == "all":
            compile_decoder_layers(model)
        self.optimizer = make_adamw(trainable_parameters(model), optimizer_implementation, lr=learning_rate,
                                    weight_decay=weight_decay, betas=betas, eps=adam_epsilon)
        self.version = version
        # several learners: called with (gradients, rows, version) after backward, before clipping; returns
        # an object with .grads (the group's mean gradient, or None to step on this learner's own),
        # .resync/.reason (this learner is out of step: OutOfStep is raised, nothing changes) and .metrics
        self.gradient_averager: Callable | None = None
        self.update_lock = contextlib.nullcontext()
        self._diagnostics_state: dict = {}  # the previous step's gradient and update, for step_diagnostics

    # Per-step gradient and movement diagnostics (swarm/losses/step_diagnostics.py: StepDiagnostics): the
    # positive- and negative-advantage parts' gradient norms, the update's size and direction, KL by
    # staleness. Off: they cost three extra backward passes and one forward. Set True to turn on
    # (benchmarks/gepo_weak_spot.py does, for the whole process).
    step_diagnostics: bool = False
    # Called with each phase's name as the step begins it, on the host in launch order (collate, forward,
    # loss, backward per micro-batch; then clip, optimizer, done): benchmarks/learner_breakdown.py records
    # a CUDA event at each, to time the phases on the device. None: nothing is called.
    phase_mark: Callable[[str], None] | None = None

    def _mark(self, phase: str) -> None:
        if self.phase_mark is not None:
            self.phase_mark(phase)

    @torch.no_grad()
    def _logprobs_after_step(self, key):
        batch, temperature, top_k, top_p = key
        dev = self.device
        with self._autocast():
            return completion_logprobs(
                self.model, batch.prompt_ids.to(dev), batch.prompt_mask.to(dev), batch.completion_ids.to(dev),
                batch.completion_mask.to(dev), temperature=temperature, top_k=top_k, top_p=top_p,
                chunk=self.logprob_chunk)

    @classmethod
    def from_settings(cls, model, pad_token_id: int, settings: TrainingSettings, **kwargs) -> "LearnerCore":
        """The learner for a role's training settings (LearnerConfig or TrainerConfig)."""
        return cls(model, pad_token_id, loss=settings.loss, learning_rate=settings.effective_learning_rate,
                   lr_warmup_steps=settings.lr_warmup_steps, lr_scheduler_type=settings.lr_scheduler_type,
                   total_steps=settings.steps, max_grad_norm=settings.max_grad_norm,
                   weight_decay=settings.weight_decay, betas=(settings.adam_beta1, settings.adam_beta2),
                   adam_epsilon=settings.adam_epsilon, micro_batch_groups=settings.micro_batch_groups,
                   micro_batch_tokens=settings.micro_batch_tokens, logprob_chunk=settings.logprob_chunk,
                   gradient_checkpointing=settings.gradient_checkpointing, torch_compile=settings.torch_compile,
                   optimizer_implementation=settings.optimizer_implementation, **kwargs)

    def _average_with_group(self, rows: int, sums: dict) -> dict:
        """Hands this step's gradient to `gradient_averager` (see its attribute) and puts the group's
        mean gradient in its place. A non-finite local gradient is sent as no rows: the others' step
        goes on, and this learner takes it too, staying in step."""
        params = trainable_parameters(self.model)
        grads = [p.grad for p in params]
        finite = math.isfinite(sums.get("loss", 0.0)) and all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        outcome = self.gradient_averager(grads if finite else [None] * len(params), rows if finite else 0, self.version)
        if outcome.resync:
            self.optimizer.zero_grad(set_to_none=True)
            raise OutOfStep(outcome.reason, at_least=outcome.at_least)
        if outcome.grads is not None:
            for p, g in zip(params, outcome.grads):
                p.grad = g.to(device=p.device, dtype=p.dtype)
            if not finite:
                sums["loss"] = 0.0  # this learner's loss was not; the group's gradient is
        return outcome.metrics

    def step_with_group(self) -> dict[str, float]:
        """Several learners: a step on the group's gradient alone, by a learner that has no groups of
        its own this round (it stays in step with the others). Raises NothingToStep when no other
        learner brought a gradient, OutOfStep when this learner must download the run's state."""
        if self.gradient_averager is None:
            raise ValueError("a learner step needs at least one rollout group")
        started = time.time()
        learning_rate = self.learning_rate * self.lr_factor(self.version)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = learning_rate
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self._average_with_group(0, {"loss": 0.0})
        if all(p.grad is None for p in trainable_parameters(self.model)):
            raise NothingToStep("no learner of the group had rollouts this round")
        grad_norm = torch.nn.utils.clip_grad_norm_(
            trainable_parameters(self.model), self.max_grad_norm if self.max_grad_norm > 0 else float("inf"))
        with self.update_lock:
            self.optimizer.step()
            self.version += 1
        return {**metrics, "grad_norm": float(grad_norm), "learning_rate": learning_rate, "groups": 0.0,
                "completion_tokens": 0.0, "version": float(self.version), "step": self.version,
                "optimizer_seconds": time.time() - started}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        """One optimizer step on `groups`; returns metrics (loss's own plus reward, staleness, ...).
        Raises NonFiniteStep, leaving everything as it was, when the loss or gradient is not finite."""
        if not groups:
            raise ValueError("a learner step needs at least one rollout group")
        sampling = {(g.temperature, g.top_k, g.top_p) for g in groups}
        if len(sampling) > 1:
            raise ValueError(f"rollout groups were sampled with different settings {sorted(sampling)}; step on them separately")
        temperature, top_k, top_p = sampling.pop()
        started = time.time()
        learning_rate = self.learning_rate * self.lr_factor(self.version)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = learning_rate
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = totals_of(groups)
        sums: dict[str, float] = {}
        diagnostics = StepDiagnostics(self.model, self.loss, self._diagnostics_state) if self.step_diagnostics else None
        fresh_gap, fresh_tokens = 0.0, 0  # sampler-learner log-prob gap on groups of the current version
        dev = self.device
        # advantages over the whole batch, before it is cut: BNPO's ("beta") weights come from a Beta
        # density fitted to every group's accuracy in the step, not a micro-batch's
        advantages = group_advantages(
            torch.tensor([math.nan if r is None else float(r) for g in groups for r in g.rewards]),
            torch.tensor([i for i, g in enumerate(groups) for _ in range(g.size)]), self.advantage_mode)
        row = 0
        # each micro-batch's metrics stay on the device until every backward is launched, then reach the
        # host together: a read-back per micro-batch would leave a GPU idle while the next one is collated
        parts: list[tuple[dict[str, torch.Tensor], float, torch.Tensor, torch.Tensor]] = []
        for chunk in plan_micro_batches(groups, self.micro_batch_groups, self.micro_batch_tokens):
            self._mark("collate")
            batch = collate(chunk, self.pad_token_id)
            adv = advantages[row : row + batch.completion_ids.size(0)]  # micro-batches are consecutive groups
            row += batch.completion_ids.size(0)
            mask = batch.completion_mask.to(dev)
            self._mark("forward")
            with self._autocast(), torch.profiler.record_function("learner/forward"):
                learner = completion_logprobs(
                    self.model, batch.prompt_ids.to(dev), batch.prompt_mask.to(dev), batch.completion_ids.to(dev),
                    mask, temperature=temperature, top_k=top_k, top_p=top_p, chunk=self.logprob_chunk,
                    compiled_head=self.torch_compile != "off",
                )
            self._mark("loss")
            sampler = batch.sampler_logprobs.to(dev)
            with batch_totals(totals):
                inputs = LossInputs(learner, sampler, mask, adv.to(dev), batch.group_ids.to(dev))
                out = compute_loss(inputs, self.loss)
                if diagnostics is not None:  # extra gradients of the loss's parts, before backward frees the graph
                    diagnostics.micro_batch(inputs, self.version - batch.versions.to(dev), (batch, temperature, top_k, top_p))
            self._mark("backward")
            with torch.profiler.record_function("learner/backward"):
                out.loss.backward()
            fresh = (batch.versions.to(dev) == self.version)[:, None] * mask
            parts.append((out.metrics, batch.completion_ids.size(0) / totals.rows,
                          ((learner.detach().float() - sampler).abs() * fresh).sum(), fresh.sum()))
        self._mark("clip")
        for metrics, share, gap, fresh in _on_host(parts, dev):
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (v if k in ADDITIVE_METRICS else v * share)
            fresh_gap += gap
            fresh_tokens += int(fresh)
        if self.gradient_averager is not None:  # several learners: the group's mean gradient replaces ours
            sums.update(self._average_with_group(totals.rows, sums))
        grad_norm = torch.nn.utils.clip_grad_norm_(
            trainable_parameters(self.model), self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        )
        if not (math.isfinite(sums.get("loss", 0.0)) and math.isfinite(float(grad_norm))):
            # AdamW would write NaN into every parameter, and the next version would carry it
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStep(f"step from version {self.version}: loss {sums.get('loss')}, gradient norm {float(grad_norm)}; "
                                "skipped", {**sums, "grad_norm": float(grad_norm)})
        staleness = [self.version - g.version for g in groups]
        rewards = [r for g in groups for r in g.rewards if r is not None]
        if diagnostics is not None:
            diagnostics.before_update()
        self._mark("optimizer")
        # another thread may copy the weights and optimizer state (swarm.team)
        with self.update_lock, torch.profiler.record_function("learner/optimizer"):
            self.optimizer.step()
            self.version += 1
        self._mark("done")
        if diagnostics is not None:
            sums.update(diagnostics.finish(self._logprobs_after_step))
        sums.update(
            grad_norm=float(grad_norm),
            learning_rate=learning_rate,
            reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
            accuracy=sum(r >= 0.5 for r in rewards) / max(len(rewards), 1),
            staleness_mean=sum(staleness) / len(staleness),
            staleness_min=min(staleness),
            staleness_max=float(max(staleness)),
            staleness_hist=staleness_histogram(staleness),
            groups=float(len(groups)),
            completion_tokens=float(sum(g.num_tokens() for g in groups)),
            # mean |log p - log q| per token over groups sampled from the version stepped from: near
            # 0 when samplers run these weights; a standing alarm for a broken weight sync
            fresh_logprob_gap=fresh_gap / fresh_tokens if fresh_tokens else float("nan"),
            version=float(self.version),
            step=self.version,
            optimizer_seconds=time.time() - started,
        )
        return sums
