"""The sampler peer: holds a policy version, generates and scores rollout groups for prompts drawn
at random (seeded by its id), streams them to the learner, and picks up new versions as they are
announced (only versions announced under the learner keys it was given; swarm.fabric.weights.follower
fetches them in the background, from other samplers that hold them or from the learner). It
serves the versions it holds to any peer that asks (at most `upload_slots` at once) and lists
them in its heartbeat, which a thread of its own sends (swarm.fabric.membership.pulse), whatever the
generation loop is doing. Groups the learner refuses or cannot take are counted by reason, not
sent again.

In its run directory: ready.json once it has joined, events.jsonl (versions fetched: from which
peer, bytes, seconds; versions used; groups sent, accepted and refused by reason, each round;
throughput every `progress_every_s`) and config.yaml.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from peers.lifecycle import Peer
from swarm.config import SamplerConfig, write_config
from swarm.config.learner_keys import decode_learner_key
from swarm.dashboard import peer_dashboard
from swarm.fabric.membership.addresses import check_reachable
from swarm.fabric.membership.pulse import Pulse
from swarm.fabric.membership.records import Heartbeat, Refusals
from swarm.fabric.transports import join_with
from swarm.fabric.weights.follower import VersionFollower
from swarm.fabric.weights.versions import MAX_HELD_VERSIONS, VersionStore, payload_limit
from swarm.generation import SamplingParams, make_backend
from swarm.lora import AdapterSpec
from swarm.model.device import resolve_device, resolve_dtype
from swarm.model.loading import resolve_model_dir
from swarm.progress import LineProgress
from swarm.reporting import Reporter
from swarm.rewards import RewardScorer
from swarm.runlog import EventLog, write_ready
from swarm.sampling import produce_rollouts
from swarm.staleness import SecondsDelay
from swarm.tasks import load_problems, shard_for_sampler

logger = logging.getLogger(__name__)


class WrongBaseModel(RuntimeError):
    """A LoRA run's base model is not the one this sampler holds: it must not sample for that run."""


def base_mismatch(run_id: str, model: str, announced: str, ours: str) -> str:
    return (f"run '{run_id}' is a LoRA run on the base model with hash {announced}, but this sampler's --model "
            f"{model!r} hashes to {ours}: its rollouts would come from another policy, so it samples nothing for this "
            f"run. Start it with --model set to the learner's base model (the same files, in float32 or bfloat16)")


def load_version(backend, state, previous) -> None:
    """Swap a version into the backend: only the tensors that changed since `previous` where the
    backend takes a part (vLLM), checked there; everything once more when a partial update did not
    take."""
    import torch

    if not (backend.partial_updates and previous is not None):
        backend.load_state_dict(state)
        return
    changed = {name: t for name, t in state.items() if name not in previous or not torch.equal(t, previous[name])}
    try:
        backend.load_state_dict(changed, previous=previous)
    except RuntimeError as exc:
        logger.warning("%s; loading the whole version again", exc)
        backend.load_state_dict(state, previous=None)


class Sampler(Peer):
    """The sampler peer: `setup` loads the model and task and joins, `step` generates one round of
    groups with the version it may use and sends them to a learner, `heartbeat` says what it holds
    (from the pulse's thread), `stop` closes everything it opened.

    config: the sampler's settings; echo: hears what it says; stop: ends the run when set;
    progress (swarm.progress; default: plain lines through `echo`): how far a long version download is."""

    def __init__(self, config: SamplerConfig, *, echo: Callable[[str], None] = print, stop: threading.Event | None = None,
                 progress=None) -> None:
        super().__init__(echo=echo, stop=stop)
        self.config = config
        self.sampler_id = config.sampler_id or f"sampler-{os.getpid()}"
        self.progress = progress or LineProgress(self.say)
        self.run_dir = Path(config.run_dir or f"runs/{self.sampler_id}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.dashboard = None
        self.sampling = self.params = None  # the run's sampling settings, as the learner last announced them
        self.current: int | None = None  # the version it generates with
        self.sent = self.done = self.tokens_total = 0  # groups accepted, rounds, tokens generated
        self.refused: Counter = Counter()
        self.ended_at: int | None = None  # the version at which the learner announced the end of the run
        self.adapter: AdapterSpec | None = None  # a LoRA run's adapter, put on the backend at the first version

    def say(self, message: str) -> None:
        self.echo(f"{self.sampler_id}: {message}")

    # -- set up -----------------------------------------------------------------------------------

    def setup(self) -> None:
        config = self.config
        self.keys = [decode_learner_key(k) for k in config.learner_keys]
        self.delay = SecondsDelay.parse(config.pickup_delay)
        check_reachable(config.transport, config.peers)  # --peers where nothing listens: now, not after the model has loaded
        self._load_model_and_task()  # bad ones fail before anything is made
        with self.first_start_in(self.run_dir):
            write_config(config, self.run_dir / "config.yaml")
            self.fabric = self.hold(join_with(config, "sampler"), close="shutdown")
            # --dashboard-port: the swarm as this sampler's own fabric reads it
            self.dashboard = self.hold(peer_dashboard(config, self.fabric, run_dir=self.run_dir, learner_keys=self.keys,
                                                      announcements_from="the learner key(s) this sampler follows"))
        self._open_exchange()
        self._follow_versions()
        fabric = self.fabric
        write_ready(self.run_dir, role="sampler", run_id=config.run_id, transport=fabric.transport, peer_id=fabric.peer_id,
                    sampler_id=self.sampler_id, addresses=fabric.addresses(),
                    **({"dashboard": self.dashboard.url} if self.dashboard else {}))
        self.echo(f"sampler {self.sampler_id} ({fabric.peer_id}) joined run '{config.run_id}' ({fabric.transport}), "
                  f"run directory {self.run_dir}")
        if self.dashboard is not None:
            self.say(f"dashboard of run '{config.run_id}' at {self.dashboard.url}")
        self.unreachable = fabric.unreachable_errors()

    def _load_model_and_task(self) -> None:
        config = self.config
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if config.backend == "transformers":
            options = {"device": device, "dtype": dtype}
        else:
            options = {"dtype": dtype, "gpu_memory_utilization": config.gpu_memory_utilization, "max_model_len": config.max_model_len,
                       "tensor_parallel_size": config.tensor_parallel_size, "enforce_eager": config.enforce_eager,
                       "max_lora_rank": config.max_lora_rank}
        self.backend = make_backend(config.backend, resolve_model_dir(config.model), **options)
        problems = load_problems(config.task, config.task_options(), tokenizer=self.backend.tokenizer)
        self.problems = shard_for_sampler(problems, self.sampler_id)

    def _open_exchange(self) -> None:
        """Its logs, its scorer, the versions it holds and relays, and its line to the learners."""
        config = self.config
        self.reporter = self.hold(Reporter(self.run_dir, config.report_to, config=config.model_dump(mode="json")))
        self.events = self.hold(EventLog(self.run_dir, on_write=self.reporter.event))
        self.scorer = self.hold(RewardScorer(config.reward_spec()))  # the learner rescores with the same
        simulating = self.delay.kind != "none" or config.lag_steps > 0
        # holding many versions only matters for latency simulation (versions wait for their pickup time)
        self.store = VersionStore(capacity=max(4, config.lag_steps + 2, MAX_HELD_VERSIONS if simulating else 0))
        self.server = self.hold(self.fabric.weight_server(self.store))  # relays the versions it holds to other samplers
        self.sender = self.hold(self.fabric.rollout_sender())
        self.rng = random.Random(self.sampler_id)

    def _follow_versions(self) -> None:
        """The heartbeat, then the follower that fetches announced versions (and pokes the heartbeat)."""
        config = self.config
        # what the heartbeat says (the generation loop and the follower update it; the pulse reads it)
        self.status = {"version": 0, "sent": 0, "tokens_per_s": 0.0, "fetch": None}
        self.refusals = Refusals()  # for its record: `swarm status` flags a sampler whose groups are all refused
        self.pulse = self.hold(Pulse(self.heartbeat, self.fabric.heartbeat_s, name="sampler-heartbeat",
                                     farewell=lambda: self.heartbeat(leaving=True)))
        # no weight payload may be larger than this model's weights could be
        max_payload = payload_limit(self.backend.model.state_dict() if config.backend == "transformers" else None)
        self.follower = self.hold(VersionFollower(self.fabric, self.store, self.keys, self.delay,
                                                  random.Random(f"{self.sampler_id}-delay"), echo=self.say,
                                                  on_fetch=self._fetched, max_payload_bytes=max_payload, progress=self.progress))

    # -- heartbeat --------------------------------------------------------------------------------

    def heartbeat(self, leaving: bool = False) -> None:
        """Its membership record: version, throughput, refusals, and the versions it can relay
        (`leaving`: the last one, as it stops)."""
        fabric, status, refusals = self.fabric, self.status, self.refusals
        last = status["fetch"]
        with self.store.lock:  # a peer nobody can dial offers nothing to relay: every try would fail
            holds = tuple(self.store.states) if fabric.dialable else ()
        fabric.heartbeat(Heartbeat(role="sampler", model=self.config.model, version=status["version"], rollouts=status["sent"],
                                   tokens_per_s=status["tokens_per_s"], holds=holds, relay=fabric.dialable,
                                   heartbeat_s=fabric.heartbeat_s, refused=refusals.total, refused_in_a_row=refusals.in_a_row,
                                   refusal=refusals.last, leaving=leaving,
                                   **(last.heartbeat_fields() if last else {})))

    def _fetched(self, result) -> None:
        self.events.event("version_fetched", **result.event_fields())
        self.status["fetch"] = result
        self.pulse.poke()  # others may fetch it from here now

    # -- run --------------------------------------------------------------------------------------

    def main_loop(self) -> None:
        """Rounds until `config.rounds` or a stop."""
        config = self.config
        self.started_at = self.last_progress = time.time()
        while not self.stopping and (config.rounds is None or self.done < config.rounds):
            if self.follower.ended:  # signed by the run's learner key, as versions are
                self.ended_at = self.follower.newest
                self.events.event("run_ended", version=self.ended_at)
                self.say(f"the learner ended the run at version {self.ended_at}; stopping")
                break
            self.step()
        self.follower.halt()  # a fetch finishing now would write its event after "stopped"
        self.events.event("stopped", **self.result())

    def step(self) -> None:
        """One round: the newest version it may use, the run's sampling settings, a round of groups
        generated, scored and sent to a learner."""
        choice = self.follower.usable(self.config.lag_steps, have_one=self.current is not None)
        if choice is None and self.current is None:
            self._wait_for_a_first_version()
            return
        if choice is not None and choice != self.current:
            self._follow_adapter(self.follower.sampling)
            self._use_version(choice)
        if self.follower.sampling != self.sampling:
            self._sample_as_announced(self.follower.sampling)
        groups, tokens = self._generate()
        if self._send(groups, tokens):
            self._report()

    def _wait_for_a_first_version(self) -> None:
        if time.time() - self.started_at > self.config.wait_s:
            raise TimeoutError(f"no version within {self.config.wait_s:.0f}s: {self.follower.diagnose(self.config.run_id)}")
        self.stop_event.wait(0.5)

    def _follow_adapter(self, sampling) -> None:
        """A LoRA run: this sampler's base model must be the announced one (by hash; else it stops with
        WrongBaseModel, having sampled nothing), and carries the run's adapter from then on."""
        if sampling is None or not sampling.lora_r or self.adapter is not None:
            return
        spec = AdapterSpec(sampling.lora_r, sampling.lora_alpha, tuple(sampling.lora_targets), sampling.base_hash)
        ours = self.backend.base_hash()
        if ours != spec.base_hash:
            message = base_mismatch(self.config.run_id, self.config.model, spec.base_hash, ours)
            self.events.event("wrong_base_model", announced=spec.base_hash, ours=ours)
            raise WrongBaseModel(message)
        if self.config.backend == "transformers":
            self.backend.use_adapter(spec, merged=self.config.lora_merged)
        else:
            self.backend.use_adapter(spec)
        self.adapter = spec
        self.events.event("adapter", r=spec.r, alpha=spec.alpha, target_modules=list(spec.target_modules),
                          base_hash=spec.base_hash)
        self.say(f"the run trains {spec.describe()}; base model {ours[:16]}... matches")

    def _use_version(self, choice: int) -> None:
        swap = time.time()
        with self.store.lock:
            state = self.store.states[choice]
            previous = self.store.states.get(self.current) if self.current is not None else None
        load_version(self.backend, state, previous)
        newest = self.follower.newest
        self.events.event("version_used", version=choice, newest=newest, swap_seconds=round(time.time() - swap, 4))
        self.say(f"now at version {choice} (newest announced {newest}, swap {time.time() - swap:.2f}s)")
        self.current = self.status["version"] = choice

    def _sample_as_announced(self, sampling) -> None:
        """Generation follows the run's sampling settings, as the learner announces them."""
        config = self.config
        self.sampling = sampling
        self.params = SamplingParams(num_completions=config.num_generations, temperature=sampling.temperature,
                                     top_k=sampling.top_k, top_p=sampling.top_p, max_new_tokens=sampling.max_tokens,
                                     stop_strings=list(sampling.stop))
        self.events.event("sampling", temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                          max_tokens=sampling.max_tokens, stop=list(sampling.stop))
        self.say(f"sampling as the learner announces: temperature {sampling.temperature:g}, top-k "
                 f"{sampling.top_k}, top-p {sampling.top_p:g}, at most {sampling.max_tokens} tokens, stop strings "
                 f"{list(sampling.stop) or 'none'}")
        if config.stop_strings and tuple(config.stop_strings) != sampling.stop:
            self.say(f"warning: --stop-strings {config.stop_strings} ignored; the learner's run stops at {list(sampling.stop)}")

    def _generate(self) -> tuple[list, int]:
        """One round's groups for prompts drawn from its shard, and their tokens."""
        problems = self.problems
        batch = [problems[self.rng.randrange(len(problems))] for _ in range(self.config.prompts_per_round)]
        groups = produce_rollouts(self.backend, self.scorer, batch, self.params, version=self.current, sampler_id=self.sampler_id)
        tokens = sum(g.num_tokens() for g in groups)
        self.tokens_total += tokens
        self.done += 1
        return groups, tokens

    def _send(self, groups: list, tokens: int) -> bool:
        """Sends the round's groups and counts the learner's answers; False when it could not be reached."""
        # several learners train the run: each round's groups go to the next of them (each group is used once)
        learners = self.follower.learner_peers or (self.follower.learner_peer,)
        learner = learners[self.done % len(learners)]
        try:
            acks = self.sender.send(learner, groups)
        except self.unreachable as exc:  # fault-tolerance boundary: the learner may be restarting
            self.refused["learner unreachable"] += len(groups)
            self.refusals.count([{"ok": False, "reason": "learner unreachable"}] * len(groups))
            self.events.event("sent", learner=learner, version=self.current, groups=len(groups), accepted=0,
                              refused={"learner unreachable": len(groups)}, tokens=tokens)
            if not self.follower.ended:  # a learner that ended its run is not coming back: no retry to announce
                self.say(f"learner {learner} unreachable ({type(exc).__name__}); retrying")
            self.stop_event.wait(2.0)
            return False
        accepted = sum(bool(a.get("ok")) for a in acks)
        self.sent += accepted
        round_refused = Counter(a.get("reason", "?") for a in acks if not a.get("ok"))
        self.refusals.count(acks)
        self.refused.update(round_refused)
        self.events.event("sent", learner=learner, version=self.current, groups=len(groups), accepted=accepted,
                          refused=dict(round_refused), tokens=tokens)
        return True

    def _report(self) -> None:
        """Throughput for the heartbeat each round; a progress line every `progress_every_s`."""
        now = time.time()
        self.status.update(sent=self.sent, tokens_per_s=self.tokens_total / max(now - self.started_at, 1e-6))
        if now - self.last_progress <= self.config.progress_every_s:
            return
        current, elapsed = self.current, now - self.started_at
        behind = (self.follower.newest or current) - current
        rate, tokens_rate = self.done * self.config.prompts_per_round / elapsed, self.tokens_total / elapsed
        self.events.event("progress", version=current, behind=behind, groups_per_s=round(rate, 3),
                          tokens_per_s=round(tokens_rate, 1), rounds=self.done, accepted=self.sent, refused=dict(self.refused))
        self.say(f"version {current} ({behind} behind), {rate:.1f} groups/s, {tokens_rate:.0f} tokens/s, "
                 f"{self.sent} accepted, refused {dict(self.refused) or 'none'}")
        self.last_progress = now

    # -- stop -------------------------------------------------------------------------------------

    def result(self) -> dict:
        """What `run_sampler` returns and the `stopped` event records."""
        return {"sent": self.sent, "rounds": self.done, "version": self.current, "refused": dict(self.refused),
                "run_dir": str(self.run_dir), "run_ended_at": self.ended_at}


def run_sampler(config: SamplerConfig, *, echo=print, stop: threading.Event | None = None, progress=None) -> dict:
    """Run a sampler until `stop` (or SIGINT/SIGTERM) or `config.rounds`. `echo` hears what it
    says; `progress` (swarm.progress; default: plain lines through `echo`) how far a long version
    download is."""
    return Sampler(config, echo=echo, stop=stop, progress=progress).run()
