"""The sampler peer: holds a policy version, generates and scores rollout groups, streams them to
the learner, and picks up new versions as they are announced (only versions announced under the
learner keys it was given). It also serves the versions it holds, relaying them to other samplers.

New versions are fetched by a background thread, so generation pauses only for the weight swap
itself (a `load_state_dict` between two rounds). For experiments on one machine, the pickup of a
version can be delayed by a random number of seconds (`pickup_delay`, the paper's log-normal
latency model) and generation can lag a fixed number of versions behind (`lag_steps`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter

logger = logging.getLogger(__name__)


def usable_version(held: list[int], ready_at: dict[int, float], newest: int | None, lag_steps: int, now: float,
                   *, have_one: bool) -> int | None:
    """The newest held version whose pickup time has come and that is at least `lag_steps` behind
    the newest announced one. When none qualifies: None if the sampler already has a version (it
    keeps it), else the oldest held one (a sampler must start with something, and while the
    learner is younger than the lag nothing older exists)."""
    if not held:
        return None
    limit = (newest if newest is not None else max(held)) - lag_steps
    ok = [v for v in held if ready_at.get(v, float("inf")) <= now and v <= limit]
    if ok:
        return max(ok)
    return None if have_one else min(held)


class VersionFollower:
    """Background thread: polls the learners' announcements and fetches each new version into
    `store` (deltas when it can), stamping each with the time it may be used."""

    def __init__(self, fabric, store, learner_keys: list[bytes], delay, rng: random.Random, *, echo, poll_s: float = 1.0):
        self.fabric, self.store, self.keys, self.delay, self.rng, self.echo = fabric, store, learner_keys, delay, rng, echo
        self.poll_s = poll_s
        self.client = fabric.weight_client()
        self.ready_at: dict[int, float] = {}
        self.newest: int | None = None  # newest version announced
        self.learner_peer: str | None = None
        self.stop = threading.Event()
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="version-follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from swarm.fabric.weight_delta import CorruptVersion

        unreachable = self.fabric.unreachable_errors()
        while not self.stop.is_set():
            try:
                ann = self.fabric.latest_announced(self.keys)
            except Exception as exc:  # noqa: BLE001  a DHT hiccup: try again next poll
                logger.debug("announcement lookup failed: %s", exc)
                ann = None
            if ann is not None:
                self.newest, self.learner_peer = ann.version, ann.peer_id
                if self.store.latest is None or ann.version > self.store.latest:
                    started = time.time()
                    try:
                        self.client.fetch(ann.peer_id, ann.version, ann.hash, self.store)
                    except (*unreachable, CorruptVersion, KeyError) as exc:  # fault-tolerance boundary
                        self._failures += 1
                        if self._failures in (1, 10) or self._failures % 100 == 0:
                            self.echo(f"could not fetch version {ann.version} from {ann.peer_id} ({type(exc).__name__}: {exc}); retrying")
                    else:
                        self._failures = 0
                        ready = time.time() + self.delay.draw(self.rng)
                        with self.store.lock:
                            for v in self.store.states:
                                self.ready_at.setdefault(v, ready)
                        logger.info("fetched version %d in %.2fs", ann.version, time.time() - started)
                        continue  # look again at once: the learner may be further ahead already
            self.stop.wait(self.poll_s)

    def usable(self, lag_steps: int, *, have_one: bool) -> int | None:
        with self.store.lock:
            return usable_version(list(self.store.states), self.ready_at, self.newest, lag_steps, time.time(), have_one=have_one)

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=30)
        self.client.close()


def run_sampler(config, *, echo=print, stop: threading.Event | None = None) -> dict:
    import os

    from peers.common import decode_learner_key, install_stop_signals, join, load_problems
    from peers.generation import SamplingParams
    from peers.generation.transformers_backend import TransformersBackend
    from swarm.fabric.versions import VersionStore
    from swarm.model.loading import load_policy
    from swarm.rewards import RewardScorer
    from swarm.sampling import produce_rollouts
    from swarm.staleness import SecondsDelay
    from swarm.tasks import shard_for_sampler

    stop = stop or threading.Event()
    install_stop_signals(stop)
    sampler_id = config.sampler_id or f"sampler-{os.getpid()}"
    keys = [decode_learner_key(k) for k in config.learner_keys]
    delay = SecondsDelay.parse(config.pickup_delay)
    model, tokenizer = load_policy(config.model)
    backend = TransformersBackend(model, tokenizer)
    scorer = RewardScorer()
    problems = shard_for_sampler(load_problems(config, tokenizer), sampler_id)
    fabric = join(config, "sampler")
    simulating = delay.kind != "none" or config.lag_steps > 0
    # holding many versions only matters for latency simulation (versions wait for their pickup time)
    store = VersionStore(capacity=max(4, config.lag_steps + 2, 64 if simulating else 0))
    server = fabric.weight_server(store)  # relay what we hold
    sender = fabric.rollout_sender()
    rng = random.Random(sampler_id)
    follower = VersionFollower(fabric, store, keys, delay, random.Random(f"{sampler_id}-delay"), echo=lambda m: echo(f"{sampler_id}: {m}"))
    echo(f"sampler {sampler_id} ({fabric.peer_id}) joined run '{config.run_id}' ({fabric.transport})")
    params = SamplingParams(num_completions=config.group_size, max_new_tokens=config.max_new_tokens, temperature=config.temperature)
    unreachable = fabric.unreachable_errors()
    current: int | None = None
    sent = done = tokens_total = 0
    refused: Counter = Counter()
    started_at = last_progress = time.time()
    last_heartbeat = 0.0
    try:
        while not stop.is_set() and (config.rounds is None or done < config.rounds):
            choice = follower.usable(config.lag_steps, have_one=current is not None)
            if choice is None and current is None:
                if time.time() - started_at > config.wait_s:
                    raise TimeoutError(f"no version from a learner within {config.wait_s:.0f}s; check --learner-key and --peers")
                stop.wait(0.5)
                continue
            if choice is not None and choice != current:
                swap = time.time()
                with store.lock:
                    state = store.states[choice]
                model.load_state_dict(state)
                echo(f"{sampler_id}: now at version {choice} (newest announced {follower.newest}, swap {time.time() - swap:.2f}s)")
                current = choice
            batch = [problems[rng.randrange(len(problems))] for _ in range(config.prompts_per_round)]
            groups = produce_rollouts(backend, scorer, batch, params, version=current, sampler_id=sampler_id)
            tokens_total += sum(g.num_tokens() for g in groups)
            done += 1
            try:
                acks = sender.send(follower.learner_peer, groups)
            except unreachable as exc:  # fault-tolerance boundary: the learner may be restarting
                refused["learner unreachable"] += len(groups)
                echo(f"{sampler_id}: learner {follower.learner_peer} unreachable ({type(exc).__name__}); retrying")
                stop.wait(2.0)
                continue
            sent += sum(a.get("ok", False) for a in acks)
            for ack in acks:
                if not ack.get("ok"):
                    refused[ack.get("reason", "?")] += 1
            now = time.time()
            if now - last_heartbeat > fabric.heartbeat_s:
                fabric.heartbeat(role="sampler", model=config.model[:256], version=current, rollouts=sent,
                                 tokens_per_s=tokens_total / max(now - started_at, 1e-6))
                last_heartbeat = now
            if now - last_progress > config.progress_every_s:
                behind = (follower.newest or current) - current
                echo(f"{sampler_id}: version {current} ({behind} behind), {done * config.prompts_per_round / (now - started_at):.1f} groups/s, "
                     f"{tokens_total / (now - started_at):.0f} tokens/s, {sent} accepted, refused {dict(refused) or 'none'}")
                last_progress = now
    finally:
        follower.close()
        sender.close()
        server.close()
        scorer.close()
        fabric.shutdown()
    return {"sent": sent, "rounds": done, "version": current, "refused": dict(refused)}
