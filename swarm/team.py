"""A learner's part in a run that several learners train (hivemind transport).

The run owner's learner trains alone until another learner the owner certified (swarm.fabric.membership.authority)
shows up in the membership records; from then on every step averages gradients with whichever
authorised learners are averaging (swarm.fabric.hivemind.learner_group), so all of them take the same step
and publish the same version with the same hash. Samplers send each round to the next learner
announcing the newest version, so each group is used once.

A learner that joins late, falls behind (it missed a round: killed and restarted, or slow) or holds
other weights than the rest downloads the newest state from an authorised learner: weights, AdamW
state and version, checked by hash, before it steps again. Nothing goes backwards: a learner only
ever loads a newer version than it holds, or the same version with the group's hash.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from swarm.fabric.membership.authority import CertificateError, authorises, parse
from swarm.fabric.weights.delta import state_hash
from swarm.lora import is_lora, policy_state, trainable_parameters


@dataclass
class AveragingOutcome:
    """What LearnerCore does with its gradient after a round (see LearnerCore.gradient_averager)."""

    grads: list[torch.Tensor] | None  # the group's mean gradient; None: step on this learner's own
    resync: bool = False  # out of step: download the group's state instead of stepping
    reason: str = ""
    at_least: int = 0  # (resync) the oldest version worth downloading: 0, any as new as this learner's
    metrics: dict = field(default_factory=dict)


def round_outcome(result, version: int, ours: str, leader: str | None = None) -> AveragingOutcome:
    """What a learner at `version` holding weights hashed `ours` does after an averaging round
    (`result`: a learner_group.RoundResult): step on the group's mean gradient; step alone when no
    other learner came; or download the group's state instead of stepping, when it is behind or
    holds other weights, or when a group met but its all-reduce came back incomplete (the others
    may have stepped on the full mean, and a step alone would publish other weights as the same
    version). `leader`: another learner present that steps alone in this one's place (leader_of),
    whose next version this one then takes; None: this one leads, or is the only learner."""
    metrics = {"learners": float(len(result.members)), "averaging_seconds": round(result.seconds, 4),
               "group_rows": float(result.total_rows)}
    if result.clamped:
        metrics["clamped_gradients"] = float(result.clamped)
    if len(result.members) == 1:
        if result.partial:
            return AveragingOutcome(None, resync=True, reason=f"this learner's averaging round came back incomplete "
                                                              f"({result.error})", metrics=metrics)
        if leader is not None:
            # both stepping alone would publish version + 1 twice, under two different weights
            return AveragingOutcome(None, resync=True, at_least=version + 1, metrics=metrics,
                                    reason=f"no other learner joined this round ({result.error}); learner {leader} "
                                           f"steps alone while both are present, and this one takes its version "
                                           f"{version + 1} rather than publish that number under other weights")
        return AveragingOutcome(None, metrics=metrics)  # nobody else came: anyone out of step catches up
    newest, digest = result.canonical
    if not result.in_step:
        reason = (f"behind: the group is at version {newest}, this learner at {version}" if newest > version else
                  f"weights differ from the group's at version {version} (hash {digest[:12]}, ours {ours[:12]})")
        return AveragingOutcome(None, resync=True, reason=reason, metrics=metrics)
    if result.grads is None:
        return AveragingOutcome(None, metrics={**metrics, "averaging_error": result.error or "no rows in the group"})
    return AveragingOutcome(result.grads, metrics=metrics)


def leader_of(ours: str, ours_is_owners: bool, others: dict[str, bool]) -> str:
    """Which learner steps alone when averaging rounds find no group while several learners are
    present (`others`: peer id -> whether it is the run owner's own learner): the owner's, when it is
    one of them, else the lowest peer id. Each of them stepping alone would publish the next version
    number under other weights (samplers would hold one, the others verify against another); the
    rest take the leader's version instead."""
    if ours_is_owners:
        return ours
    owners = sorted(p for p, is_owners in others.items() if is_owners)
    return owners[0] if owners else min([ours, *others])


class LearnerTeam:
    """Finds the run's authorised learners, averages each step's gradient with them, serves this
    learner's state to the others and catches up from theirs.

    fabric: a hivemind fabric (`learner_group`, `members`); owners: the run owner's public-key
    subkeys (a learner's certificate must be signed by one); weights_hash: the hash of this learner's
    float32 weights (what members compare every round)."""

    def __init__(self, fabric, core, owners: frozenset[bytes], *, weights_hash: Callable[[], str],
                 averaging_timeout_s: float, events=None, echo=print) -> None:
        self.fabric, self.core, self.owners = fabric, core, frozenset(owners)
        self.weights_hash = weights_hash
        self.averaging_timeout_s = averaging_timeout_s
        self.events, self.echo = events, echo
        self.owner = next(iter(sorted(self.owners)))  # the run key samplers pin
        self.joining = False  # set by a learner that must download the run's state before it publishes
        self.group = None
        self.lock = threading.Lock()  # the model and optimizer between steps: state is copied under it
        self.stats = {"rounds": 0, "alone": 0, "yielded": 0, "incomplete": 0, "resyncs": 0, "diverged": 0, "largest_group": 1}
        core.update_lock = self.lock
        core.gradient_averager = self
        self.check_own_certificate()  # a revoked learner stops here, before it trains or publishes

    def learners(self) -> dict[str, object]:
        """peer id -> membership record of every live learner the run owner authorised (this one too):
        read from the owners' own learner directories (swarm.fabric.hivemind.records), never from the
        open member list, which anyone can flood; certificates expired or revoked are left out."""
        return {peer: record for peer, (record, _) in self._authorised().items()}

    def _authorised(self) -> dict[str, tuple[object, bool]]:
        """peer id -> (membership record, whether the run owner's key signed it itself) of `learners`."""
        found = {}
        for member in self.fabric.authorised_learners(self.owners):
            record = member.record
            if member.owner in self.owners or (record.certificate and authorises(
                    record.certificate, self.fabric.run_id, self.owners, member.owner)):
                found[record.peer_id] = (record, member.owner in self.owners)
        return found

    def leader(self) -> str | None:
        """The other learner present that steps alone in this one's place (leader_of), or None when
        this one leads or is alone."""
        ours = self.fabric.peer_id
        others = {peer: is_owners for peer, (_, is_owners) in self._authorised().items() if peer != ours}
        if not others:
            return None
        leader = leader_of(ours, getattr(self.fabric, "public_key", None) in self.owners, others)
        return None if leader == ours else leader

    def check_own_certificate(self) -> None:
        """Raise CertificateError, naming the key and what to do, when this learner's certificate
        has expired or the run owner revoked its key: it must not train the run."""
        certificate = getattr(self.fabric, "certificate", "")
        if not certificate:
            return
        problem = parse(certificate).problem(revoked=self.fabric.revoked(self.owners))
        if problem:
            raise CertificateError(problem)

    def others(self) -> dict[str, object]:
        return {p: r for p, r in self.learners().items() if p != self.fabric.peer_id}

    def wait_for_others(self, timeout_s: float) -> bool:
        """Whether another authorised learner's record shows up within `timeout_s`."""
        deadline = time.time() + timeout_s
        while not self.others():
            if time.time() > deadline:
                return False
            time.sleep(1.0)
        return True

    def refresh(self, start: bool = True) -> int:
        """Starts averaging once another authorised learner is present (`start`: only from the main
        thread, as hivemind's averager process must be) and lets the current ones in; returns how many
        learners there are. Called from the heartbeat and before every step."""
        others = self.others()
        if others and self.group is None and start:
            self._start_group()
        if self.group is not None:
            self.group.allow([self.fabric.peer_id, *others])
            self.group.serve_state(self._state, self.core.version)
        return 1 + len(others)

    def _start_group(self) -> None:
        averaged = trainable_parameters(self.core.model)  # a LoRA run's adapter alone: its base is frozen
        self.group = self.fabric.learner_group(averaged)
        if self.events is not None:
            self.events.event("learner_group", peer_id=self.group.peer_id, elements=sum(p.numel() for p in averaged))

    # --- one round (LearnerCore.gradient_averager) ---
    def __call__(self, grads, rows: int, version: int) -> AveragingOutcome:
        if self.group is None or not self.others():
            return AveragingOutcome(None, metrics={"learners": 1.0})
        ours = self.weights_hash()
        result = self.group.average(grads, rows, version, ours, self.averaging_timeout_s,
                                    others_present=lambda: bool(self.others()))
        self.stats["rounds"] += 1
        alone = len(result.members) == 1
        outcome = round_outcome(result, version, ours, leader=self.leader() if alone and not result.partial else None)
        if alone:
            self.stats["incomplete" if result.partial else "yielded" if outcome.resync else "alone"] += 1
            if not outcome.resync and self.events is not None:
                self.events.event("averaging_alone", version=version, reason=result.error)
            return outcome
        self.stats["largest_group"] = max(self.stats["largest_group"], len(result.members))
        if not result.in_step:
            return outcome  # this learner is the one out of step: it downloads the group's state
        stragglers = [m for m in result.members if (m.version, m.weights_hash) != result.canonical]
        if stragglers and self.events is not None:
            self.events.event("learners_out_of_step", version=version,
                              peers={m.peer_id: {"version": m.version, "hash": m.weights_hash[:16]} for m in stragglers})
        return outcome

    # --- state handed to others, and taken from them ---
    def _state(self) -> tuple[dict, list[torch.Tensor]]:
        """This learner's weights, AdamW state and version (hivemind's state-serving thread calls it)."""
        with self.lock:
            params = trainable_parameters(self.core.model)
            tensors = []
            for p in params:
                state = self.core.optimizer.state.get(p, {})
                tensors += [p.detach().cpu().clone(),
                            state["exp_avg"].detach().cpu().clone() if "exp_avg" in state else torch.zeros_like(p, device="cpu"),
                            state["exp_avg_sq"].detach().cpu().clone() if "exp_avg_sq" in state else torch.zeros_like(p, device="cpu"),
                            torch.as_tensor(float(state["step"]) if "step" in state else 0.0, dtype=torch.float32)]
            metadata = {"run_id": self.fabric.run_id, "version": self.core.version, "hash": self.weights_hash()}
        return metadata, tensors

    def catch_up(self, timeout_s: float, *, at_least: int = 0, beat: Callable[[], object] | None = None,
                 beat_s: float = 5.0) -> bool:
        """Downloads the newest authorised learner's state (a version >= `at_least` and newer than, or
        the group's hash at, this learner's own) and loads it; False if none came within `timeout_s`.
        Only learners whose record shows a version >= `at_least` are asked (a state is large).
        `beat` (every `beat_s`) keeps this learner's record up meanwhile: the others let it in on seeing it."""
        if self.group is None:
            self._start_group()
        deadline, next_beat = time.time() + timeout_s, 0.0
        while time.time() < deadline:
            if beat is not None and time.time() >= next_beat:
                beat()
                next_beat = time.time() + beat_s
            others = self.others()
            if not others and at_least > self.core.version:
                return False  # the learner whose next version this one waited for has left: it steps on alone
            if others:
                self.group.allow([self.fabric.peer_id, *others])
                order = sorted((p for p in others if others[p].version >= at_least), key=lambda p: -others[p].version)
                found = self.group.download_state(order, timeout_s=min(30.0, max(1.0, deadline - time.time()))) if order else None
                if found is not None and self._load(*found, at_least=at_least):
                    return True
            time.sleep(1.0)
        return False

    def _load(self, peer: str, metadata: dict, tensors: list[torch.Tensor], *, at_least: int) -> bool:
        params = trainable_parameters(self.core.model)
        try:
            version, digest = int(metadata["version"]), str(metadata["hash"])
            ok_shapes = len(tensors) == 4 * len(params) and all(
                tensors[4 * i].shape == p.shape for i, p in enumerate(params))
        except (KeyError, TypeError, ValueError):
            ok_shapes, version, digest = False, -1, ""
        if not ok_shapes or metadata.get("run_id") != self.fabric.run_id or version < max(at_least, self.core.version):
            self.echo(f"warning: state from learner {peer} refused (version {version}, run {metadata.get('run_id')!r}, "
                      f"{len(tensors)} tensors)")
            return False
        with self.lock:
            saved = [p.detach().clone() for p in params]
            with torch.no_grad():
                for i, p in enumerate(params):
                    p.copy_(tensors[4 * i].to(p.device, p.dtype))
            if self.weights_hash() != digest:  # torn or forged: put ours back
                with torch.no_grad():
                    for p, old in zip(params, saved):
                        p.copy_(old)
                self.echo(f"warning: state from learner {peer} does not match its hash; refused")
                return False
            self.core.optimizer.state.clear()
            fused = bool(self.core.optimizer.defaults.get("fused"))  # the fused kernel keeps its step count on the device
            for i, p in enumerate(params):
                exp_avg, exp_avg_sq, step = tensors[4 * i + 1], tensors[4 * i + 2], float(tensors[4 * i + 3])
                if step > 0:
                    self.core.optimizer.state[p] = {"step": torch.tensor(step, device=p.device if fused else None), "exp_avg": exp_avg.to(p.device, p.dtype),
                                                    "exp_avg_sq": exp_avg_sq.to(p.device, p.dtype)}
            previous, self.core.version = self.core.version, version
        self.stats["resyncs"] += 1
        if self.events is not None:
            self.events.event("state_downloaded", source=peer, version=version, previous=previous, hash=digest)
        self.echo(f"took the run's state from learner {peer}: version {version} (was {previous})")
        return True

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def float32_hash(model) -> str:
    """The hash of a model's weights in float32 (what learners of one run compare): a LoRA run's
    adapter alone (its base is frozen, and pinned by the run's announcements)."""
    if is_lora(model):
        return state_hash({k: v.float() for k, v in policy_state(model, copy=True).items()})
    return state_hash({k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu()
                       for k, v in model.state_dict().items()})
