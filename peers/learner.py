"""The learner peer: gathers rollout groups from samplers, checks them (swarm.intake), steps the
policy (swarm.training), and publishes each new version (signed announcement + weights served to
any peer that asks). In its run directory: ready.json once it has joined (peer id, addresses,
`--learner-key`; also alone in learner.key), steps.jsonl (one record per step), events.jsonl, config.yaml and
checkpoints.

Versions are published in the background (swarm.fabric.weights.publisher): the next step trains
while the last version is encoded, hashed and announced, and a version the publisher could not keep
up with is skipped (the next delta carries its change). Versions never go backwards: every published
version is recorded in `published.json` before it is announced, and a resumed learner continues
after the newest of that, its last step record, its checkpoint and the announcement still in the swarm. When the checkpoint is older than what was published (a learner
killed between checkpoints), its weights are published under a new version number, so samplers
holding the lost versions see a newer version and fetch it in full.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections import deque
from typing import Callable

from peers.learner_setup import check_run_dir, join_team, logged_version, publish_isolation, published_version
from peers.lifecycle import Peer
from swarm.checkpoint import load_verified, save_checkpoint
from swarm.config import LearnerConfig, write_config
from swarm.config.learner_keys import encode_learner_key
from swarm.dashboard import peer_dashboard
from swarm.evaluation import HeldOutEvaluation
from swarm.fabric.interface import JoinError
from swarm.fabric.membership.addresses import check_reachable
from swarm.fabric.membership.pulse import Pulse
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.rollouts.bans import PeerBans
from swarm.fabric.rollouts.wire import WireLimits
from swarm.fabric.transports import join_with
from swarm.fabric.weights.announcements import RunSampling
from swarm.fabric.weights.sharer_view import SharerView
from swarm.fabric.weights.delta import non_finite_tensors, state_hash
from swarm.fabric.weights.publisher import Publisher
from swarm.fabric.weights.versions import MAX_HELD_VERSIONS, VersionStore
from swarm.intake import GroupIntake
from swarm.lora import AdapterSpec, adapter_spec, base_state, describe, is_lora, policy_state, wrap_for
from swarm.model.device import resolve_device, resolve_dtype, torch_dtype
from swarm.model.loading import load_policy
from swarm.progress import LineProgress
from swarm.reporting import Reporter
from swarm.rewards import RewardScorer
from swarm.runlog import EventLog, StepLog, write_json_atomic, write_ready
from swarm.tasks import load_problems
from swarm.team import LearnerTeam
from swarm.training import LearnerCore, NonFiniteStep, NothingToStep, OutOfStep
from swarm.verification import GapEvidence, LogprobVerifier

STEP_TIMES_KEPT = 20  # the learner's usual step time is the median of this many recent steps


class Learner(Peer):
    """The learner peer: `setup` loads (or resumes) the policy and joins, `step` trains on one batch
    and publishes the new version, `heartbeat` announces it (from the pulse's thread), `checkpoint`
    saves it, `stop` closes everything it opened.

    config: the learner's settings; echo: hears what it says; stop: ends the run when set;
    progress (swarm.progress; default: plain lines through `echo`): how far a long checkpoint write is."""

    def __init__(self, config: LearnerConfig, *, echo: Callable[[str], None] = print, stop: threading.Event | None = None,
                 progress=None) -> None:
        super().__init__(echo=echo, stop=stop)
        self.config = config
        self.progress = progress or LineProgress(echo)
        self.team: LearnerTeam | None = None
        self.dashboard = self.pulse = None  # no pulse yet: the first version is announced in the caller's thread
        self.ended = False  # set once the last step is trained: announcements then say the run has ended
        self.publisher: Publisher | None = None
        self.checked_version: int | None = None  # the newest version found finite (handed to the publisher)
        self.started = False  # whether the training loop began: only a run that started records its stop
        self.totals = {"used": 0, "tokens_per_s": 0.0, "skipped_steps": 0, "gap_warnings": 0}
        # for its record (`swarm status` flags a learner that stops stepping): when it last stepped, and
        # the seconds between its recent steps
        self.last_step, self.step_times = time.time(), deque(maxlen=STEP_TIMES_KEPT)
        self.held_out: HeldOutEvaluation | None = None  # --eval-every: made at the first evaluation

    # -- set up -----------------------------------------------------------------------------------

    def setup(self) -> None:
        import torch

        config = self.config
        self.run_dir, resume_from = check_run_dir(config)
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        # float32 master weights and optimizer state always; bfloat16 runs forward and backward under
        # autocast, and versions are published in it (what GPU samplers run, half the bytes)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.publish_dtype = torch_dtype(self.dtype)
        # once the input is known good: --peers where nothing listens fails now, not after the model has loaded
        check_reachable(config.transport, config.peers)
        resume_from = self._load_policy(resume_from)
        with self.first_start_in(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_config(config, self.run_dir / "config.yaml")
            if not resume_from:
                self._open_events()
            self.fabric = self.hold(join_with(config, "learner"), close="shutdown")
            self.team = self.hold(join_team(config, self.fabric, self.core, self.events, self.echo))
            self._catch_up_on_joining()
            if resume_from:
                self._continue_after(resume_from)
            self._open_intake()
            self._write_ready()
        self._greet()
        self._start_publishing()

    def _build_core(self, model, tokenizer) -> LearnerCore:
        return LearnerCore.from_settings(model.to(self.device), tokenizer.pad_token_id, self.config,
                                         autocast_dtype=self.publish_dtype if self.dtype != "float32" else None)

    def _load_policy(self, resume_from):
        """The model, its tokenizer, the learner core and the task's answers; the checkpoint it
        resumed from (an older one where the newest is damaged), or None for a fresh run."""
        config = self.config
        if resume_from:
            self._open_events()
            chosen = resume_from if self.config.resume_from is not None else None  # --resume-from: that one, no fallback
            resume_from, self.core, self.tokenizer = load_verified(self.run_dir, self._build_core, warn=self._warn_damaged,
                                                                   chosen=chosen)
            self.model, self.core.version = self.core.model, resume_from.version
        else:
            self.model, self.tokenizer = load_policy(config.model)  # a bad --model fails here, before anything is made
            self.model = wrap_for(self.model, config)  # --lora-r: the base frozen, an adapter on it trains
            self.core = self._build_core(self.model, self.tokenizer)
        self._pin_base()
        problems = load_problems(config.task, config.task_options(), tokenizer=self.tokenizer)
        self.answers = {p.problem_id: p.answer for p in problems}
        self.prompts = {p.problem_id: p.prompt for p in problems}  # a group's prompt must be its problem's
        return resume_from

    def _pin_base(self) -> None:
        """A LoRA run's adapter and the hash of its frozen base, announced with every version."""
        config = self.config
        if is_lora(self.model) != bool(config.lora_r):
            raise ValueError(f"the checkpoint is {'a LoRA' if is_lora(self.model) else 'a full fine-tuning'} run's; resume "
                             f"it with {'the same --lora-r' if is_lora(self.model) else '--lora-r 0'}")
        self.adapter = adapter_spec(self.model, state_hash(base_state(self.model))) if config.lora_r else None
        if self.adapter is not None:
            trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            self.echo(f"{self.adapter.describe()}: {trained:,} of {sum(p.numel() for p in self.model.parameters()):,} "
                      f"parameters train; base model {self.adapter.base_hash[:16]}... frozen")

    def _check_run_adapter(self, announced) -> None:
        """One more learner of a run trains what the run trains (its announcements say what)."""
        if announced is not None:
            s = announced.sampling
            theirs = AdapterSpec(s.lora_r, s.lora_alpha, tuple(sorted(s.lora_targets)), s.base_hash) if s.lora_r else None
            if theirs != self.adapter:
                raise ValueError(f"run '{self.config.run_id}' trains {describe(theirs)}, this learner {describe(self.adapter)}: "
                                 "start it with the run's --model and --lora-r/--lora-alpha/--lora-target-modules")

    def _warn_damaged(self, message: str) -> None:
        self.events.event("damaged_checkpoint", message=message)
        self.echo(f"warning: {message}")

    def _open_events(self) -> None:
        self.events = EventLog(self.run_dir)
        self.at_stop(self._close_events)  # held first: it records the stop once everything else is closed

    def _close_events(self) -> None:
        if self.started:  # a start that failed records no stop
            self.events.event("stopped", **self.result())
        self.events.close()

    def _catch_up_on_joining(self) -> None:
        """One more learner of a run downloads the run's state first, then follows its versions."""
        team, fabric, config = self.team, self.fabric, self.config
        if team is None or not team.joining:
            return
        self._check_run_adapter(fabric.latest_announced([team.owner]))
        if not team.wait_for_others(3 * fabric.heartbeat_s + 5):
            self.echo(f"no other learner of run '{config.run_id}' is up: this one starts it")  # an offline owner's first learner
            return
        self.echo(f"joining run '{config.run_id}' as one more learner: downloading the state of a running learner")
        if not team.catch_up(max(60.0, 2 * config.averaging_timeout_s), beat_s=fabric.heartbeat_s, beat=self._joining_beat):
            raise JoinError(f"no learner of run '{config.run_id}' served its state; check that the run owner's learner "
                            "is running and reachable through --peers, and that --certificate was issued for this run")
        # again before the first step: a learner that joined before the owner's first announcement was
        # checked against nothing, and the state it downloaded does not say which base it was trained over
        self._check_run_adapter(fabric.latest_announced([team.owner]))

    def _joining_beat(self) -> None:
        self.fabric.heartbeat(Heartbeat(role="learner", model=self.config.model, version=self.core.version,
                                        certificate=self.fabric.certificate))

    def _continue_after(self, resume_from) -> None:
        """Versions never go backwards: a checkpoint older than what was published or recorded continues after it."""
        own = self.fabric.latest_announced([self.fabric.public_key])
        # (and the steps recorded: a version trained but not yet published when the learner died
        # keeps its number too, so no two step records share one)
        newest = max(v for v in (published_version(self.run_dir), own.version if own else None, resume_from.version,
                                 logged_version(self.run_dir)) if v is not None)
        if newest > resume_from.version:
            self.echo(f"checkpoint is at version {resume_from.version} but {newest} was published or trained; its weights continue as version {newest + 1}")
            self.core.version = newest + 1
        self.echo(f"resumed from {resume_from.path}")
        self.events.event("resumed", checkpoint=str(resume_from.path), version=self.core.version)

    def _open_intake(self) -> None:
        """The versions it serves, the inbox samplers send to, and the checks each group passes."""
        config, tokenizer = self.config, self.tokenizer
        # the newest version whole, older ones as undo deltas rebuilt on demand (65 whole versions
        # of a 0.6B policy would take 78 GB); forward deltas for half a snapshot: a sampler further
        # behind gets the snapshot. A LoRA run's adapter moves in every element at every step, so its
        # deltas are 0.8-0.95 of a snapshot: one snapshot's worth of them is kept (a sampler one
        # version behind still saves a fifth)
        self.store = VersionStore(capacity=max(8, min(config.max_staleness, MAX_HELD_VERSIONS) + 1), whole_states=1,
                                  cached_states=1, delta_budget=1.0 if config.lora_r else 0.5)
        self.server = self.hold(self.fabric.weight_server(self.store))
        # the ids a policy can emit: its output layer's rows, which models pad past the tokenizer
        # (Qwen3: 151,936 rows for 151,669 tokens), so an honest sampler may draw a padding id
        vocab = max(len(tokenizer), self.model.get_output_embeddings().weight.shape[0])
        self.inbox = self.hold(self.fabric.rollout_inbox(
            vocab_size=vocab, max_staleness=config.max_staleness,
            # a short queue: backpressure holds samplers back instead of letting a backlog of old
            # groups raise staleness
            capacity=config.groups_per_step * 2,
            bans=PeerBans(config.ban_after, config.ban_window_s, config.ban_s),
            limits=WireLimits.for_run(getattr(self.model.config, "max_position_embeddings", None), config.max_completion_length)))
        self.verifier = LogprobVerifier(self.model, self.store.states, pad_token_id=tokenizer.pad_token_id,
                                        fraction=config.verify_fraction, tolerance=config.verify_tolerance,
                                        evidence=GapEvidence(ban_after=config.verify_ban_after, window=config.verify_ban_window))
        self.intake = self.hold(GroupIntake(
            self.answers, decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
            stop_strings=config.stop_strings, prompts=self.prompts, encode=lambda text: tokenizer(text)["input_ids"],
            max_staleness=config.max_staleness, max_age_s=config.max_age_s, penalise=self.inbox.penalise,
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, verifier=self.verifier,
            banned=lambda peer: self.inbox.bans.remaining(peer) > 0,
            scorer=RewardScorer(config.reward_spec())))

    def _write_ready(self) -> None:
        """learner.key and ready.json, which say how to join; the dashboard, which ready.json names."""
        config, fabric, team = self.config, self.fabric, self.team
        learner_key = encode_learner_key(fabric.public_key)
        # samplers pin the run's owner key: this learner's own, or the one that certified it
        self.run_key = encode_learner_key(team.owner) if team is not None else learner_key
        (self.run_dir / "learner.key").write_text(self.run_key + "\n")  # for `swarm sampler --learner-key-file`
        # --dashboard-port: the swarm as this learner's own fabric reads it
        self.dashboard = self.hold(peer_dashboard(config, fabric, run_dir=self.run_dir, announcements_from="this run's learner key",
                                                  learner_keys=[team.owner if team is not None else fabric.public_key]))
        owner_key_file = str(fabric.signing_key_path) if fabric.signing_key_path and self.run_key == learner_key else None
        write_ready(self.run_dir, role="learner", run_id=config.run_id, transport=fabric.transport, peer_id=fabric.peer_id,
                    addresses=fabric.addresses(), learner_key=self.run_key, own_key=learner_key, owner_key_file=owner_key_file,
                    **({"dashboard": self.dashboard.url} if self.dashboard else {}))

    def _greet(self) -> None:
        config, fabric = self.config, self.fabric
        self.echo(f"learner {fabric.peer_id} for run '{config.run_id}' ({fabric.transport}), run directory {self.run_dir}")
        self.echo(f"samplers join with: --learner-key {self.run_key}")
        if self.dashboard is not None:
            self.echo(f"dashboard of run '{config.run_id}' at {self.dashboard.url}")
        for addr in fabric.addresses():
            self.echo(f"  --peers {addr}")

    def _start_publishing(self) -> None:
        """Publishes the first version, then starts the heartbeat and the step records."""
        config = self.config
        self.last_step = time.time()
        adapter = self.adapter
        self.sampling = RunSampling(config.temperature, config.top_k, config.top_p, config.max_completion_length,
                                    tuple(config.stop_strings),
                                    *((adapter.r, adapter.alpha, adapter.target_modules, adapter.base_hash) if adapter else ()))
        # who fetches each new delta, named in its announcement (sharer_view.SharerView)
        self.sharers = self.hold(SharerView(self.fabric))
        # encodes, hashes and announces versions while the next step trains (closed after the pulse)
        isolation, idle = publish_isolation(config.publish_isolation, self.device, self.published_bytes())
        self.publisher = self.hold(Publisher(self.store, on_published=self._published, on_encoding=self.sharers.publishing,
                                             isolation=isolation, idle=idle))
        self.publish(now=True)
        # announcements and the membership record on their own schedule: a step longer than a record's
        # life (any real LLM's) no longer takes the learner out of the listing
        self.pulse = self.hold(Pulse(self.heartbeat, self.fabric.heartbeat_s, name="learner-heartbeat",
                                     farewell=lambda: self.heartbeat(leaving=True)))
        self.reporter = self.hold(Reporter(self.run_dir, config.report_to, config=config.model_dump(mode="json")))
        self.steps = self.hold(StepLog(self.run_dir, on_write=self.reporter.step))
        self.last_step = time.time()

    # -- run --------------------------------------------------------------------------------------

    def main_loop(self) -> None:
        """Steps until `config.steps` or a stop, then checkpoints; a crash checkpoints what is sound."""
        self.started = True
        try:
            while self.core.version < self.config.steps and not self.stopping:
                self.step()
            self.publisher.wait()  # the last version trained is published too
            if self.core.version >= self.config.steps:
                self._announce_end()  # before the checkpoint: samplers stop generating for nobody at once
            self.checkpoint()  # at exit, also on Ctrl-C / SIGTERM
        except Exception as exc:
            # progress since the last checkpoint is not lost to a crash: save what is sound, then fail
            self.events.event("crashed", version=self.core.version, error=f"{type(exc).__name__}: {exc}")
            if self.checked_version == self.core.version:  # the current version was found finite when handed over
                self.checkpoint()
            raise

    def step(self) -> None:
        """One round: gather a batch and train on it; with none, take the other learners' step, or wait."""
        batch, gather_s = self._gather()
        team = self.team
        if not batch and team is not None and team.group is not None and not self.stopping:
            if self._step_on_others_groups():
                return
        if not batch:
            if not self.stopping:
                self.events.event("waiting", seconds=round(gather_s, 1), version=self.core.version)
                self.echo(f"no rollouts for {gather_s:.0f}s; waiting for samplers")
            return
        self._train(batch)

    def _gather(self) -> tuple[list, float]:
        """The groups that pass intake within the gathering time: (batch, seconds it gathered for)."""
        config = self.config
        # several learners: each gathers its share of the run's batch, and goes to the round in time
        learners = self.team.refresh() if self.team is not None else 1
        share = max(1, math.ceil(config.groups_per_step / learners))
        gather_s = min(config.wait_s, config.averaging_timeout_s / 2) if learners > 1 else config.wait_s
        # first the groups of a step that did not happen (the learner took another's state instead)
        batch, deadline = self.intake.take_held(self.core.version, share), time.time() + gather_s
        while len(batch) < share and time.time() < deadline and not self.stopping:
            # groups whose check waited for an old version's rebuild in the background (never here)
            batch += self.intake.resume(self.core.version, limit=share - len(batch))
            if len(batch) >= share:
                break
            group = self.inbox.get(timeout=1.0)
            if group is not None and self.intake.accept(group, self.core.version):
                batch.append(group)
        return batch, gather_s

    def _step_on_others_groups(self) -> bool:
        """No groups here: take the others' step all the same, so as to stay in step. False when
        there was no step to take."""
        try:
            metrics = self.core.step_with_group()
        except NothingToStep:
            return False
        except OutOfStep as exc:
            self._catch_up_after(exc)
            return True
        self.publish()
        self.steps.step(metrics, seconds=time.time() - self.last_step, used_total=self.totals["used"], team=dict(self.team.stats),
                        weights_hash=self.store.hashes.get(self.core.version))
        self._stepped()
        self.echo(f"step {self.core.version}: on the other learners' groups only")
        return True

    def _train(self, batch: list) -> None:
        """One optimizer step on `batch`, then publish, record and (when due) checkpoint."""
        core, totals = self.core, self.totals
        try:
            metrics = core.step(batch)
        except NonFiniteStep as exc:  # nothing changed: count it and train on the next batch
            totals["skipped_steps"] += 1
            self.events.event("skipped_step", version=core.version, reason=str(exc), groups=len(batch))
            self.echo(f"warning: {exc}")
            return
        except OutOfStep as exc:  # another learner is ahead or holds other weights: take the run's state
            self.intake.hold_over(batch)  # and train on this batch at the next step
            self._catch_up_after(exc, held_over=len(batch))
            return
        totals["used"] += len(batch)
        totals["tokens_per_s"] = metrics["completion_tokens"] / max(metrics["optimizer_seconds"], 1e-6)
        self.publish()
        metrics.update(self._evaluate_if_due())
        self._record_step(metrics)
        self._stepped()
        self.echo(f"step {core.version}: reward {metrics['reward_mean']:.3f}, staleness {metrics['staleness_mean']:.1f} "
                  f"(max {metrics['staleness_max']:.0f}), {len(batch)} groups, dropped {dict(self.intake.dropped)}")
        self._watch_logprob_gap(metrics["fresh_logprob_gap"])
        if self.config.checkpoint_every and core.version % self.config.checkpoint_every == 0:
            self.checkpoint()

    def _evaluate_if_due(self) -> dict:
        """--eval-every: held-out pass@1 of the new version, for its step record ({} when not due)."""
        config, version = self.config, self.core.version
        if not config.eval_every or version % config.eval_every:
            return {}
        if self.held_out is None:  # built at the first evaluation: a run without any pays nothing
            problems = load_problems(config.task, config.task_options(), tokenizer=self.tokenizer, split="test")
            self.held_out = self.hold(HeldOutEvaluation(
                self.model, self.tokenizer, problems[: config.eval_problems], samples=config.eval_samples,
                temperature=config.temperature, max_completion_length=config.max_completion_length, seed=config.seed,
                stop_strings=config.stop_strings))
        found = self.held_out.run()
        self.echo(f"held-out pass@1 at version {version}: {found['eval_pass_at_1']:.3f} ({found['eval_seconds']:.1f}s)")
        return found

    def _record_step(self, metrics: dict) -> None:
        verifier, server, inbox = self.verifier, self.server, self.inbox
        self.steps.step(metrics, seconds=time.time() - self.last_step, used_total=self.totals["used"],
                        dropped=dict(self.intake.dropped), weights_hash=self.store.hashes.get(self.core.version),
                        inbox_refused=dict(inbox.stats.reasons), banned=inbox.bans.banned(),
                        skipped_steps=self.totals["skipped_steps"], verified=verifier.checked,
                        verify_seconds=round(verifier.seconds, 4), largest_honest_gap=verifier.largest_honest_gap,
                        verify_deferred=self.intake.deferrals, groups_held_over=self.intake.held_over,
                        uploads=server.served, uploaded_bytes=server.bytes_served, uploads_refused_busy=server.slots.refused,
                        **({"team": dict(self.team.stats)} if self.team is not None else {}))

    def _stepped(self) -> None:
        self.step_times.append(time.time() - self.last_step)
        self.last_step = time.time()

    def _watch_logprob_gap(self, gap: float) -> None:
        """Warns (now and then) when samplers' log-probs on current groups are far from the learner's."""
        threshold = self.config.fresh_gap_warning
        if gap == gap and gap > threshold:  # NaN: no fresh group this step
            self.totals["gap_warnings"] += 1
            self.events.event("logprob_gap", version=self.core.version, gap=gap, threshold=threshold)
            if self.totals["gap_warnings"] in (1, 10) or self.totals["gap_warnings"] % 100 == 0:
                self.echo(f"warning: samplers' log-probs differ from the learner's by {gap:.3f} per token on groups of the "
                          f"current version (threshold {threshold:g}): a sampler may not be running the "
                          "weights it claims (a failed weight update), or runs another precision or model")

    def _catch_up_after(self, exc: OutOfStep, *, held_over: int = 0) -> None:
        """Another learner is ahead or holds other weights: download the run's state, publish it
        (`held_over`: groups of this step's batch kept for the next one)."""
        self.events.event("out_of_step", version=self.core.version, reason=str(exc), groups_held_over=held_over)
        self.echo(f"out of step with the other learners ({exc}); downloading the run's state")
        if self.team.catch_up(2 * self.config.averaging_timeout_s, at_least=exc.at_least):
            self.publish()

    # -- publish, heartbeat, checkpoint -----------------------------------------------------------

    def publish(self, *, now: bool = False) -> None:
        """Makes the current weights the next published version (in the dtype samplers run): a
        snapshot is taken here, and the publisher encodes, hashes and announces it in the background
        (`now`: in this thread, as the first version is, before anything else happens)."""
        core = self.core
        # a tied parameter once (swarm/tied_weights.py), or a LoRA run's adapter alone (swarm/lora.py),
        # copied (where the weights are, or into the encoding process's shared memory): the next step
        # changes them while the publisher encodes the copy
        state = self.publisher.copy_state(policy_state(self.model), self.publish_dtype)
        bad = non_finite_tensors(state)
        if bad:  # cannot happen after a finite step; if it does, nothing of it leaves this process
            raise RuntimeError(f"version {core.version} holds non-finite weights ({', '.join(bad[:3])}); not published. "
                               f"Resume from the last checkpoint in {self.run_dir / 'checkpoints'} with a lower --learning-rate")
        self.checked_version = core.version
        if now:
            self.publisher.publish_now(core.version, state)
        else:
            self.publisher.submit(core.version, state)  # raises when the publisher failed

    def published_bytes(self) -> int:
        """The size of a version in the dtype samplers run (its tensors are not copied to tell)."""
        return sum(t.numel() * (self.publish_dtype.itemsize if t.is_floating_point() else t.element_size())
                   for t in policy_state(self.model).values())

    def _published(self, version: int, digest: str) -> None:
        """A version is held and hashed (the publisher's thread): record it, then have it announced."""
        # atomic: a torn file would let a resumed learner announce an older version number
        write_json_atomic(self.run_dir / "published.json", {"version": version, "hash": digest})
        self.inbox.learner_version = version  # before announcing: groups at the new version are welcome
        self.events.event("published", version=version, hash=digest, skipped=len(self.publisher.skipped))
        if self.pulse is None:
            self.heartbeat()  # the first version is announced before anything else happens
        else:
            self.pulse.poke()  # announce from the heartbeat thread: a slow swarm never holds up training

    def heartbeat(self, leaving: bool = False) -> None:
        """Announces the newest version and refreshes this learner's membership record (from the
        pulse's thread, on its own schedule; `leaving`: the last one, as it stops)."""
        store, fabric = self.store, self.fabric
        with store.lock:
            version = store.latest
            digest, holds, recent = store.hashes[version], tuple(store.states), dict(store.hashes)
        chunks = store.chunk_specs(version, quick=True)
        fabric.announce(version, digest, self.sampling, recent, chunks, self.sharers.announced(version, chunks), ended=self.ended)
        fabric.heartbeat(Heartbeat(role="learner", model=self.config.model, model_hash=digest[:16], version=version,
                                   rollouts=self.totals["used"], tokens_per_s=self.totals["tokens_per_s"], holds=holds,
                                   certificate=getattr(fabric, "certificate", ""), heartbeat_s=fabric.heartbeat_s,
                                   step_s=statistics.median(list(self.step_times)) if self.step_times else 0.0,
                                   since_step_s=time.time() - self.last_step, leaving=leaving))
        if self.team is not None and not leaving:
            self.team.refresh(start=False)  # lets new learners in; the training loop starts averaging
        if self.pulse is not None and not leaving and store.snapshot_due(version):
            store.chunk_specs(version)  # the snapshot's, for new samplers: announced at the next beat, at once
            self.pulse.poke()

    def _announce_end(self) -> None:
        """The run is over (its last step is trained and published): announce the last version once
        more, marked as the run's end and signed like every announcement, so that samplers leave
        rather than retry a learner that is gone. (A stop by Ctrl-C or SIGTERM is not an end: the
        learner may be resumed, and its samplers wait for it.)"""
        self.pulse.farewell = None  # the last word is said here, where a failure is reported
        self.pulse.close()  # no beat of its own in between: the last word is the end
        self.ended = True
        try:
            self.heartbeat(leaving=True)
        except Exception as exc:  # noqa: BLE001  fault-tolerance boundary: the run has ended all the same
            self.echo(f"warning: could not announce the end of the run ({type(exc).__name__}: {exc}); its samplers keep "
                      "retrying until they are stopped")
            return
        self.events.event("run_ended", version=self.core.version)
        self.echo(f"run ended at version {self.core.version}: announced to the samplers, which now stop")

    def master_hash(self) -> str:
        """The hash of the float32 weights a checkpoint holds (what --resume checks them against);
        the published version's own hash when it is published in float32."""
        if self.dtype == "float32" and self.core.version in self.store.hashes:
            return self.store.hashes[self.core.version]
        return state_hash(policy_state(self.model))

    def checkpoint(self) -> None:
        """Saves weights and optimizer state; a failed write is reported, not fatal: a full disk
        (torch.save raises RuntimeError there, not OSError), a permission, a safetensors error. The
        checkpoint is written aside and renamed into place only when complete (swarm.checkpoint), so a
        failed one is never taken as the latest; the next checkpoint tries again."""
        core, config = self.core, self.config
        try:
            path = save_checkpoint(self.run_dir, self.model, self.tokenizer, core.optimizer, version=core.version,
                                   digest=self.master_hash(), config=json.loads(config.model_dump_json()),
                                   base_hash=self.adapter.base_hash if self.adapter else "",
                                   keep=config.keep_checkpoints, progress=self.progress)
        except Exception as exc:  # noqa: BLE001  a fault-tolerance boundary: any failure to write is survivable
            error = f"{type(exc).__name__}: {exc}"
            self.events.event("checkpoint_failed", version=core.version, error=error[:2000])
            self.echo(f"warning: checkpoint of version {core.version} failed ({error[:500]}); training goes on in memory, "
                      f"the next checkpoint retries; free space or fix the permissions of {self.run_dir}")
            return
        self.events.event("checkpoint", version=core.version, path=str(path))
        self.echo(f"checkpoint: {path}")

    # -- stop -------------------------------------------------------------------------------------

    def result(self) -> dict:
        """What `run_learner` returns and the `stopped` event records."""
        return {"version": self.core.version, "used": self.totals["used"], "dropped": dict(self.intake.dropped),
                "run_dir": str(self.run_dir), "refused": dict(self.inbox.stats.reasons), "banned": self.inbox.bans.banned(),
                "skipped_steps": self.totals["skipped_steps"]}


def run_learner(config: LearnerConfig, *, echo=print, stop: threading.Event | None = None, progress=None) -> dict:
    """Run a learner until `config.steps` or `stop` (or SIGINT/SIGTERM). `echo` hears what it says;
    `progress` (swarm.progress; default: plain lines through `echo`) how far a long checkpoint write is."""
    return Learner(config, echo=echo, stop=stop, progress=progress).run()
