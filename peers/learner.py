"""The learner peer: gathers rollout groups from samplers, re-scores and filters them, steps the
policy with the chosen loss, and publishes each new version (signed announcement + weights served
to any peer). Logs one JSON line per step, checkpoints, and resumes, in its run directory.

Versions never go backwards: every published version is recorded in `published.json` before it is
announced, and a resumed learner continues after the newest of that, its checkpoint and the
announcement still in the DHT. When the checkpoint is older than what was published (a learner
killed between checkpoints), its weights are published under a new version number, so samplers
holding the lost versions see a newer version and fetch it in full.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

STALENESS_BINS = (0, 1, 2, 4, 8, 16, 32, 64)  # histogram bucket lower edges, in steps


def staleness_histogram(staleness: list[int]) -> dict[str, int]:
    edges = list(STALENESS_BINS) + [None]
    hist = {}
    for low, high in zip(edges[:-1], edges[1:]):
        label = f"{low}" if high == low + 1 else (f"{low}-{high - 1}" if high else f"{low}+")
        hist[label] = sum(1 for s in staleness if s >= low and (high is None or s < high))
    return hist


def published_version(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "published.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def prepare_run_dir(config) -> tuple[Path, object]:
    """(run_dir, checkpoint to resume from or None); refuses to mix a fresh run into an old one."""
    from swarm.checkpoint import latest_checkpoint

    run_dir = Path(config.run_dir)
    found = latest_checkpoint(run_dir)
    if config.resume and found is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; drop --resume to start a new run")
    if not config.resume and (found is not None or (run_dir / "steps.jsonl").exists()):
        raise ValueError(f"run directory {run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, found


def run_learner(config, *, echo=print, stop: threading.Event | None = None) -> dict:
    from peers.common import encode_learner_key, install_stop_signals, join, load_problems
    from swarm.checkpoint import load_optimizer_state, save_checkpoint
    from swarm.config import write_config
    from swarm.fabric.bans import PeerBans
    from swarm.fabric.versions import VersionStore
    from swarm.losses import LossConfig
    from swarm.model.loading import load_policy
    from swarm.rewards import RewardScorer
    from swarm.training import LearnerCore

    stop = stop or threading.Event()
    install_stop_signals(stop)
    run_dir, resume_from = prepare_run_dir(config)
    write_config(config, run_dir / "config.yaml")
    model, tokenizer = load_policy(str(resume_from.path) if resume_from else config.model)
    core = LearnerCore(model, tokenizer.pad_token_id, loss=LossConfig(name=config.loss), lr=config.lr)
    if resume_from:
        load_optimizer_state(resume_from, core.optimizer)
        core.version = resume_from.version
    answers = {p.problem_id: p.answer for p in load_problems(config, tokenizer)}
    scorer = RewardScorer()
    fabric = join(config, "learner")
    if resume_from:
        own = fabric.latest_announced([fabric.public_key])
        newest = max(v for v in (published_version(run_dir), own.version if own else None, resume_from.version) if v is not None)
        if newest > resume_from.version:
            echo(f"checkpoint is at version {resume_from.version} but {newest} was published; its weights continue as version {newest + 1}")
            core.version = newest + 1
        echo(f"resumed from {resume_from.path}")
    store = VersionStore(capacity=max(8, min(config.max_staleness, 64) + 1))
    server = fabric.weight_server(store)
    inbox = fabric.rollout_inbox(vocab_size=len(tokenizer), max_staleness=config.max_staleness,
                                 # a short queue: backpressure holds samplers back instead of
                                 # letting a backlog of old groups raise staleness
                                 capacity=config.groups_per_step * 2,
                                 bans=PeerBans(config.ban_after, config.ban_window_s, config.ban_s))
    echo(f"learner {fabric.peer_id} for run '{config.run_id}' ({fabric.transport}), run directory {run_dir}")
    echo(f"samplers join with: --learner-key {encode_learner_key(fabric.public_key)}")
    for addr in fabric.addresses():
        echo(f"  --peers {addr}")

    totals = {"used": 0, "tokens_per_s": 0.0}
    dropped: Counter = Counter()

    def heartbeat() -> None:
        digest = store.hashes[core.version]
        fabric.announce(core.version, digest)
        fabric.heartbeat(role="learner", model=config.model[:256], model_hash=digest[:16], version=core.version,
                         rollouts=totals["used"], tokens_per_s=totals["tokens_per_s"])

    def publish() -> None:
        store.add(core.version, {k: v.detach() for k, v in model.state_dict().items()})
        (run_dir / "published.json").write_text(json.dumps({"version": core.version, "hash": store.hashes[core.version]}))
        inbox.learner_version = core.version  # before announcing: groups at the new version are welcome
        heartbeat()

    def checkpoint() -> None:
        path = save_checkpoint(run_dir, model, tokenizer, core.optimizer, version=core.version,
                               digest=store.hashes[core.version], config=json.loads(config.model_dump_json()),
                               keep=config.keep_checkpoints)
        echo(f"checkpoint: {path}")

    def accept(group) -> bool:
        """Filter one received group; counts every drop by reason (and by peer, for bad data)."""
        if core.version - group.version > config.max_staleness:
            dropped["too stale"] += 1
            return False
        if time.time() - group.created_at > config.max_age_s:
            dropped["too old"] += 1
            return False
        gold = answers.get(group.problem_id)
        if gold is None:
            dropped["unknown problem"] += 1
            inbox.penalize(group.sender, "unknown problem")
            return False
        rescored = scorer.score(group.completion_texts, [gold] * group.size)
        if any(a is not None and b is not None and abs(a - b) > 1e-6 for a, b in zip(rescored, group.rewards)):
            dropped["reward mismatch"] += 1
            inbox.penalize(group.sender, "reward mismatch")
            return False
        group.rewards = rescored
        return True

    publish()
    log = (run_dir / "steps.jsonl").open("a")
    last_heartbeat = time.time()
    try:
        while core.version < config.steps and not stop.is_set():
            batch, deadline = [], time.time() + config.wait_s
            while len(batch) < config.groups_per_step and time.time() < deadline and not stop.is_set():
                group = inbox.get(timeout=1.0)
                if time.time() - last_heartbeat > fabric.heartbeat_s:
                    heartbeat()
                    last_heartbeat = time.time()
                if group is not None and accept(group):
                    batch.append(group)
            if not batch:
                if not stop.is_set():
                    echo(f"no rollouts for {config.wait_s:.0f}s; waiting for samplers")
                continue
            started = time.time()
            staleness = [core.version - g.version for g in batch]
            warmup = min(1.0, (core.version + 1) / config.lr_warmup_steps) if config.lr_warmup_steps else 1.0
            for param_group in core.optimizer.param_groups:  # by version, so a resumed run continues the schedule
                param_group["lr"] = config.lr * warmup
            metrics = core.step(batch)
            totals["used"] += len(batch)
            totals["tokens_per_s"] = metrics["completion_tokens"] / max(time.time() - started, 1e-6)
            publish()
            last_heartbeat = time.time()
            rewards = [r for g in batch for r in g.rewards if r is not None]
            metrics.update(time=time.time(), accuracy=sum(r >= 0.5 for r in rewards) / max(len(rewards), 1),
                           staleness_min=min(staleness), staleness_hist=staleness_histogram(staleness), used_total=totals["used"],
                           dropped=dict(dropped), inbox_refused=dict(inbox.stats.reasons), banned=inbox.bans.banned())
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            echo(f"step {core.version}: reward {metrics['reward_mean']:.3f}, staleness {metrics['staleness_mean']:.1f} "
                 f"(max {metrics['staleness_max']:.0f}), {len(batch)} groups, dropped {dict(dropped)}")
            if config.checkpoint_every and core.version % config.checkpoint_every == 0:
                checkpoint()
        checkpoint()  # at exit, also on Ctrl-C / SIGTERM
    finally:
        log.close()
        inbox.close()
        server.close()
        scorer.close()
        fabric.shutdown()
    return {"version": core.version, "used": totals["used"], "dropped": dict(dropped), "run_dir": str(run_dir),
            "refused": dict(inbox.stats.reasons), "banned": inbox.bans.banned()}
