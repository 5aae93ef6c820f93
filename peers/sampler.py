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
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

from swarm.config import SamplerConfig

logger = logging.getLogger(__name__)


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


def run_sampler(config: SamplerConfig, *, echo=print, stop: threading.Event | None = None, progress=None) -> dict:
    """Run a sampler until `stop` (or SIGINT/SIGTERM) or `config.rounds`. `echo` hears what it
    says; `progress` (swarm.progress; default: plain lines through `echo`) how far a long version
    download is."""
    from swarm.config import write_config
    from swarm.dashboard import peer_dashboard
    from swarm.fabric.weights.follower import VersionFollower
    from swarm.config.learner_keys import decode_learner_key
    from swarm.fabric.membership.pulse import Pulse
    from swarm.fabric.membership.records import Heartbeat, Refusals
    from swarm.fabric.transports import join_with
    from swarm.fabric.weights.versions import MAX_HELD_VERSIONS, VersionStore, payload_limit
    from swarm.generation import SamplingParams, make_backend
    from swarm.model.device import resolve_device, resolve_dtype
    from swarm.model.loading import resolve_model_dir
    from swarm.rewards import RewardScorer
    from swarm.runlog import EventLog, write_ready
    from swarm.sampling import produce_rollouts
    from swarm.signals import install_stop_signals
    from swarm.staleness import SecondsDelay
    from swarm.progress import LineProgress
    from swarm.tasks import load_problems, shard_for_sampler

    stop = stop or threading.Event()
    install_stop_signals(stop)
    sampler_id = config.sampler_id or f"sampler-{os.getpid()}"
    progress = progress or LineProgress(lambda m: echo(f"{sampler_id}: {m}"))
    run_dir = Path(config.run_dir or f"runs/{sampler_id}-{time.strftime('%Y%m%d-%H%M%S')}")
    keys = [decode_learner_key(k) for k in config.learner_keys]
    delay = SecondsDelay.parse(config.pickup_delay)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.backend == "transformers":
        options = {"device": device, "dtype": dtype}
    else:
        options = {"dtype": dtype, "gpu_memory_utilization": config.gpu_memory_utilization, "max_model_len": config.max_model_len,
                   "tensor_parallel_size": config.tensor_parallel_size, "enforce_eager": config.enforce_eager}
    # model and task first: bad ones fail before anything is made
    backend = make_backend(config.backend, resolve_model_dir(config.model), **options)
    problems = shard_for_sampler(load_problems(config.task, config.task_options(), tokenizer=backend.tokenizer), sampler_id)
    made = not run_dir.exists()
    fabric = None
    try:  # a start that fails (no swarm, a port taken) leaves no half-made run directory
        write_config(config, run_dir / "config.yaml")
        fabric = join_with(config, "sampler")
        # --dashboard-port: the swarm as this sampler's own fabric reads it
        dashboard = peer_dashboard(config, fabric, run_dir=run_dir, learner_keys=keys,
                                   announcements_from="the learner key(s) this sampler follows")
    except BaseException:
        if fabric is not None:
            fabric.shutdown()
        if made:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    from swarm.reporting import Reporter

    reporter = Reporter(run_dir, config.report_to, config=config.model_dump(mode="json"))
    events = EventLog(run_dir, on_write=reporter.event)
    scorer = RewardScorer()
    simulating = delay.kind != "none" or config.lag_steps > 0
    # holding many versions only matters for latency simulation (versions wait for their pickup time)
    store = VersionStore(capacity=max(4, config.lag_steps + 2, MAX_HELD_VERSIONS if simulating else 0))
    server = fabric.weight_server(store)  # relays the versions it holds to other samplers
    sender = fabric.rollout_sender()
    rng = random.Random(sampler_id)
    # what the heartbeat says (the generation loop and the follower update it; the pulse reads it)
    status = {"version": 0, "sent": 0, "tokens_per_s": 0.0, "fetch": None}
    refusals = Refusals()  # for its record: `swarm status` flags a sampler whose groups are all refused

    def beat() -> None:
        last = status["fetch"]
        with store.lock:  # a peer nobody can dial offers nothing to relay: every try would fail
            holds = tuple(store.states) if fabric.dialable else ()
        fabric.heartbeat(Heartbeat(role="sampler", model=config.model, version=status["version"], rollouts=status["sent"],
                                   tokens_per_s=status["tokens_per_s"], holds=holds, relay=fabric.dialable,
                                   heartbeat_s=fabric.heartbeat_s, refused=refusals.total, refused_in_a_row=refusals.in_a_row,
                                   refusal=refusals.last,
                                   **(last.heartbeat_fields() if last else {})))

    def fetched(result) -> None:
        events.event("version_fetched", **result.event_fields())
        status["fetch"] = result
        pulse.poke()  # others may fetch it from here now

    pulse = Pulse(beat, fabric.heartbeat_s, name="sampler-heartbeat")

    follower = VersionFollower(fabric, store, keys, delay, random.Random(f"{sampler_id}-delay"),
                               echo=lambda m: echo(f"{sampler_id}: {m}"), on_fetch=fetched,
                               # no weight payload may be larger than this model's weights could be
                               max_payload_bytes=payload_limit(backend.model.state_dict() if config.backend == "transformers" else None),
                               progress=progress)
    write_ready(run_dir, role="sampler", run_id=config.run_id, transport=fabric.transport, peer_id=fabric.peer_id,
                sampler_id=sampler_id, addresses=fabric.addresses(), **({"dashboard": dashboard.url} if dashboard else {}))
    echo(f"sampler {sampler_id} ({fabric.peer_id}) joined run '{config.run_id}' ({fabric.transport}), run directory {run_dir}")
    if dashboard is not None:
        echo(f"{sampler_id}: dashboard of run '{config.run_id}' at {dashboard.url}")
    sampling = None  # the run's sampling settings, as the learner last announced them
    unreachable = fabric.unreachable_errors()
    current: int | None = None
    sent = done = tokens_total = 0
    refused: Counter = Counter()
    started_at = last_progress = time.time()
    try:
        while not stop.is_set() and (config.rounds is None or done < config.rounds):
            choice = follower.usable(config.lag_steps, have_one=current is not None)
            if choice is None and current is None:
                if time.time() - started_at > config.wait_s:
                    raise TimeoutError(f"no version within {config.wait_s:.0f}s: {follower.diagnose(config.run_id)}")
                stop.wait(0.5)
                continue
            if choice is not None and choice != current:
                swap = time.time()
                with store.lock:
                    state = store.states[choice]
                    previous = store.states.get(current) if current is not None else None
                load_version(backend, state, previous)
                events.event("version_used", version=choice, newest=follower.newest, swap_seconds=round(time.time() - swap, 4))
                echo(f"{sampler_id}: now at version {choice} (newest announced {follower.newest}, swap {time.time() - swap:.2f}s)")
                current = status["version"] = choice
            if follower.sampling != sampling:
                sampling = follower.sampling
                params = SamplingParams(num_completions=config.num_generations, temperature=sampling.temperature,
                                        top_k=sampling.top_k, top_p=sampling.top_p, max_new_tokens=sampling.max_tokens,
                                        stop_strings=list(sampling.stop))
                events.event("sampling", temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                             max_tokens=sampling.max_tokens, stop=list(sampling.stop))
                echo(f"{sampler_id}: sampling as the learner announces: temperature {sampling.temperature:g}, top-k "
                     f"{sampling.top_k}, top-p {sampling.top_p:g}, at most {sampling.max_tokens} tokens, stop strings "
                     f"{list(sampling.stop) or 'none'}")
                if config.stop_strings and tuple(config.stop_strings) != sampling.stop:
                    echo(f"{sampler_id}: warning: --stop-strings {config.stop_strings} ignored; the learner's run stops at "
                         f"{list(sampling.stop)}")
            batch = [problems[rng.randrange(len(problems))] for _ in range(config.prompts_per_round)]
            groups = produce_rollouts(backend, scorer, batch, params, version=current, sampler_id=sampler_id)
            tokens = sum(g.num_tokens() for g in groups)
            tokens_total += tokens
            done += 1
            # several learners train the run: each round's groups go to the next of them (each group is used once)
            learners = follower.learner_peers or (follower.learner_peer,)
            learner = learners[done % len(learners)]
            try:
                acks = sender.send(learner, groups)
            except unreachable as exc:  # fault-tolerance boundary: the learner may be restarting
                refused["learner unreachable"] += len(groups)
                refusals.count([{"ok": False, "reason": "learner unreachable"}] * len(groups))
                events.event("sent", learner=learner, version=current, groups=len(groups), accepted=0,
                             refused={"learner unreachable": len(groups)}, tokens=tokens)
                echo(f"{sampler_id}: learner {learner} unreachable ({type(exc).__name__}); retrying")
                stop.wait(2.0)
                continue
            accepted = sum(bool(a.get("ok")) for a in acks)
            sent += accepted
            round_refused = Counter(a.get("reason", "?") for a in acks if not a.get("ok"))
            refusals.count(acks)
            refused.update(round_refused)
            events.event("sent", learner=learner, version=current, groups=len(groups), accepted=accepted,
                         refused=dict(round_refused), tokens=tokens)
            now = time.time()
            status.update(sent=sent, tokens_per_s=tokens_total / max(now - started_at, 1e-6))
            if now - last_progress > config.progress_every_s:
                behind = (follower.newest or current) - current
                rate, tokens_rate = done * config.prompts_per_round / (now - started_at), tokens_total / (now - started_at)
                events.event("progress", version=current, behind=behind, groups_per_s=round(rate, 3),
                             tokens_per_s=round(tokens_rate, 1), rounds=done, accepted=sent, refused=dict(refused))
                echo(f"{sampler_id}: version {current} ({behind} behind), {rate:.1f} groups/s, {tokens_rate:.0f} tokens/s, "
                     f"{sent} accepted, refused {dict(refused) or 'none'}")
                last_progress = now
        result = {"sent": sent, "rounds": done, "version": current, "refused": dict(refused), "run_dir": str(run_dir)}
        events.event("stopped", **result)
        return result
    finally:
        pulse.close()
        follower.close()
        sender.close()
        server.close()
        scorer.close()
        if dashboard is not None:
            dashboard.close()  # before the fabric it reads
        fabric.shutdown()
        events.close()
        reporter.close()
