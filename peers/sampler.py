"""The sampler peer: holds a policy version, generates and scores rollout groups, streams them to
the learner, and picks up new versions as they are announced (only versions announced under the
learner keys it was given). It also serves the versions it holds, relaying them to other samplers."""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    import asyncio

    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    return (ControlFailure, ConnectionError, TimeoutError, asyncio.IncompleteReadError, OSError)


def run_sampler(*, run_id: str, peers, learner_keys: list[bytes], identity_dir: Path, sampler_id: str,
                prompts_per_round: int = 8, group_size: int = 8, max_new_tokens: int = 16, rounds: int | None = None,
                wait_s: float = 60.0, host: str = "127.0.0.1", port: int = 0, echo=print,
                stop: threading.Event | None = None) -> dict:
    from peers.common import join
    from peers.generation import SamplingParams
    from peers.generation.transformers_backend import TransformersBackend
    from swarm.fabric.records import MembershipPublisher
    from swarm.fabric.rollout_exchange import RolloutSender
    from swarm.fabric.versions import VersionStore, WeightClient, WeightServer, latest_announced
    from swarm.fabric.weight_delta import CorruptVersion
    from swarm.model.loading import load_policy
    from swarm.rewards import RewardScorer
    from swarm.sampling import produce_rollouts
    from swarm.tasks import shard_for_sampler
    from swarm.tasks.synthetic import ArithmeticTask

    UNREACHABLE = _unreachable_errors()
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    model, tokenizer = load_policy("embedded")
    backend = TransformersBackend(model, tokenizer)
    scorer = RewardScorer()
    problems = shard_for_sampler(ArithmeticTask(2).problems("train"), sampler_id)
    joined = join(run_id, peers, identity_dir, "sampler", host, port)
    dht = joined.dht
    store = VersionStore(capacity=4)
    server = WeightServer(dht, run_id, store)  # relay what we hold
    client = WeightClient(dht, run_id)
    sender = RolloutSender(dht, run_id)
    members = MembershipPublisher(dht, run_id, joined.public_key, heartbeat_s=5.0)
    echo(f"sampler {sampler_id} ({dht.peer_id}) joined run '{run_id}'")
    params = SamplingParams(num_completions=group_size, max_new_tokens=max_new_tokens)
    rng = random.Random(sampler_id)
    sent = done = 0
    refused: Counter = Counter()
    learner_peer = None
    try:
        deadline = time.time() + wait_s
        while not stop.is_set() and (rounds is None or done < rounds):
            ann = latest_announced(dht, run_id, learner_keys)
            if ann is None:
                if time.time() > deadline:
                    raise TimeoutError(f"no learner announced a version within {wait_s:.0f}s; check --learner-key and --peers")
                time.sleep(1.0)
                continue
            if store.latest != ann.version:
                swap = time.time()
                try:
                    state = client.fetch(ann.peer_id, ann.version, ann.hash, store)
                except (*UNREACHABLE, CorruptVersion, KeyError) as exc:  # fault-tolerance boundary
                    echo(f"{sampler_id}: could not fetch version {ann.version} from {ann.peer_id} "
                         f"({type(exc).__name__}: {exc}); retrying")
                    if store.latest is None:
                        time.sleep(2.0)
                        continue
                else:
                    model.load_state_dict(state)
                    echo(f"{sampler_id}: now at version {ann.version} (swap {time.time() - swap:.2f}s)")
            learner_peer = ann.peer_id
            batch = [problems[rng.randrange(len(problems))] for _ in range(prompts_per_round)]
            started = time.time()
            groups = produce_rollouts(backend, scorer, batch, params, version=store.latest, sampler_id=sampler_id)
            tokens = sum(g.num_tokens() for g in groups)
            try:
                acks = sender.send(learner_peer, groups)
            except UNREACHABLE as exc:  # fault-tolerance boundary: the learner may be restarting
                refused["learner unreachable"] += len(groups)
                echo(f"{sampler_id}: learner {learner_peer} unreachable ({type(exc).__name__}); retrying with the newest announcement")
                done += 1
                time.sleep(2.0)
                continue
            sent += sum(a.get("ok", False) for a in acks)
            for ack in acks:
                if not ack.get("ok"):
                    refused[ack.get("reason", "?")] += 1
            done += 1
            members.heartbeat(role="sampler", model="embedded", version=store.latest, rollouts=sent,
                              tokens_per_s=tokens / max(time.time() - started, 1e-6))
    finally:
        sender.close()
        client.close()
        server.close()
        scorer.close()
        dht.shutdown()
    return {"sent": sent, "rounds": done, "version": store.latest, "refused": dict(refused)}
