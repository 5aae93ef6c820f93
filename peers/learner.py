"""The learner peer: gathers rollout groups from samplers, re-scores and filters them, steps the
policy with the chosen loss, and publishes each new version (signed announcement + weights served
to any peer). Logs one JSON line per step in its run directory."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def run_learner(*, run_id: str, peers, identity_dir: Path, run_dir: Path, loss: str = "gepo", lr: float = 1e-4,
                groups_per_step: int = 16, max_staleness: int = 64, max_age_s: float = 1800.0, steps: int = 100,
                wait_s: float = 120.0, host: str = "127.0.0.1", port: int = 0, echo=print, stop: threading.Event | None = None) -> dict:
    from peers.common import encode_learner_key, join
    from swarm.fabric.records import MembershipPublisher
    from swarm.fabric.rollout_exchange import RolloutInbox
    from swarm.fabric.versions import VersionStore, WeightServer, announce
    from swarm.losses import LossConfig
    from swarm.model.loading import load_policy
    from swarm.rewards import RewardScorer
    from swarm.tasks.synthetic import ArithmeticTask
    from swarm.training import LearnerCore

    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    run_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy("embedded")
    core = LearnerCore(model, tokenizer.pad_token_id, loss=LossConfig(name=loss), lr=lr)
    answers = {p.problem_id: p.answer for p in ArithmeticTask(2).problems("train")}
    scorer = RewardScorer()
    joined = join(run_id, peers, identity_dir, "learner", host, port)
    dht = joined.dht
    store = VersionStore(capacity=max(8, min(max_staleness, 64) + 1))
    server = WeightServer(dht, run_id, store)
    inbox = RolloutInbox(dht, run_id, vocab_size=len(tokenizer), max_staleness=max_staleness, capacity=groups_per_step * 8)
    members = MembershipPublisher(dht, run_id, joined.public_key, heartbeat_s=5.0)
    echo(f"learner {dht.peer_id} for run '{run_id}'")
    echo(f"samplers join with: --learner-key {encode_learner_key(joined.public_key)}")
    for maddr in dht.get_visible_maddrs():
        echo(f"  --peers {maddr}")

    def heartbeat() -> None:
        digest = store.hashes[core.version]
        announce(dht, run_id, joined.public_key, core.version, digest)
        members.heartbeat(role="learner", model="embedded", model_hash=digest[:16], version=core.version, rollouts=used)

    def publish() -> None:
        store.add(core.version, {k: v.detach() for k, v in model.state_dict().items()})
        inbox.learner_version = core.version  # before announcing: groups at the new version are welcome
        heartbeat()

    dropped: Counter = Counter()
    used = 0
    publish()
    log = (run_dir / "steps.jsonl").open("a")
    last_heartbeat = time.time()
    try:
        while core.version < steps and not stop.is_set():
            batch, deadline = [], time.time() + wait_s
            while len(batch) < groups_per_step and time.time() < deadline and not stop.is_set():
                group = inbox.get(timeout=1.0)
                if time.time() - last_heartbeat > members.heartbeat_s:
                    heartbeat()
                    last_heartbeat = time.time()
                if group is None:
                    continue
                if core.version - group.version > max_staleness:
                    dropped["too stale"] += 1
                    continue
                if time.time() - group.created_at > max_age_s:
                    dropped["too old"] += 1
                    continue
                gold = answers.get(group.problem_id)
                if gold is None:
                    dropped["unknown problem"] += 1
                    continue
                rescored = scorer.score(group.completion_texts, [gold] * group.size)
                if any(a is not None and b is not None and abs(a - b) > 1e-6 for a, b in zip(rescored, group.rewards)):
                    dropped["reward mismatch"] += 1
                    continue
                group.rewards = rescored
                batch.append(group)
            if not batch:
                echo(f"no rollouts for {wait_s:.0f}s; waiting for samplers")
                continue
            model.train()
            metrics = core.step(batch)
            used += len(batch)
            publish()
            last_heartbeat = time.time()
            metrics.update(time=time.time(), dropped=dict(dropped), inbox_refused=sum(inbox.stats.refused.values()))
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            echo(f"step {core.version}: reward {metrics['reward_mean']:.3f}, staleness {metrics['staleness_mean']:.1f}, "
                 f"{len(batch)} groups, dropped {dict(dropped)}")
    finally:
        log.close()
        inbox.close()
        server.close()
        scorer.close()
        dht.shutdown()
    return {"version": core.version, "used": used, "dropped": dict(dropped)}
