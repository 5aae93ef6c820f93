"""The learner peer: gathers rollout groups from samplers, checks them (swarm.intake), steps the
policy (swarm.training), and publishes each new version (signed announcement + weights served to
any peer that asks). In its run directory: ready.json once it has joined (peer id, addresses,
`--learner-key`; also alone in learner.key), steps.jsonl (one record per step), events.jsonl, config.yaml and
checkpoints.

Versions never go backwards: every published version is recorded in `published.json` before it is
announced, and a resumed learner continues after the newest of that, its checkpoint and the
announcement still in the swarm. When the checkpoint is older than what was published (a learner
killed between checkpoints), its weights are published under a new version number, so samplers
holding the lost versions see a newer version and fetch it in full.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import threading
import time
from collections import deque
from pathlib import Path

from swarm.config import LearnerConfig

STEP_TIMES_KEPT = 20  # the learner's usual step time is the median of this many recent steps


def published_version(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "published.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def check_run_dir(config: LearnerConfig) -> tuple[Path, object]:
    """(run_dir, checkpoint to resume from or None); refuses to mix a fresh run into an old one.
    Makes nothing: a fresh run's directory is made once its model and task have loaded."""
    from swarm.checkpoint import latest_checkpoint

    run_dir = Path(config.run_dir)
    found = latest_checkpoint(run_dir)
    if config.resume and found is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; drop --resume to start a new run")
    if not config.resume and (found is not None or (run_dir / "steps.jsonl").exists()):
        raise ValueError(f"run directory {run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    return run_dir, found


def join_team(config: LearnerConfig, fabric, core, events, echo):
    """This learner's LearnerTeam (swarm.team) over hivemind; None over gRPC, which has no
    averaging (a --certificate there is refused). Checks the certificate names this learner and run."""
    from swarm.fabric.membership.authority import parse, read_certificate
    from swarm.config.learner_keys import encode_learner_key
    from swarm.team import LearnerTeam, float32_hash

    certificate = read_certificate(config.certificate) if config.certificate else ""
    if fabric.transport != "hivemind":
        if certificate:
            raise ValueError("--certificate: several learners average gradients through hivemind; use --transport hivemind")
        return None
    if certificate:
        cert = parse(certificate)
        if cert.learner != fabric.public_key:
            raise ValueError(f"--certificate was issued for another learner key; this learner's key is "
                             f"{encode_learner_key(fabric.public_key)} (its --identity-dir): ask the run owner for "
                             f"`swarm authorize --learner-key {encode_learner_key(fabric.public_key)} --run-id {config.run_id}`")
        if cert.run_id != config.run_id:
            raise ValueError(f"--certificate is for run '{cert.run_id}', not '{config.run_id}'")
        fabric.certificate = certificate
    team = LearnerTeam(fabric, core, frozenset({parse(certificate).owner if certificate else fabric.public_key}),
                       weights_hash=lambda: float32_hash(core.model), averaging_timeout_s=config.averaging_timeout_s,
                       events=events, echo=echo)
    team.joining = bool(certificate)
    return team


def run_learner(config: LearnerConfig, *, echo=print, stop: threading.Event | None = None, progress=None) -> dict:
    """Run a learner until `config.steps` or `stop` (or SIGINT/SIGTERM). `echo` hears what it says;
    `progress` (swarm.progress; default: plain lines through `echo`) how far a long checkpoint write is."""
    import torch

    from swarm.checkpoint import load_verified, save_checkpoint
    from swarm.config import write_config
    from swarm.dashboard import peer_dashboard
    from swarm.fabric.rollouts.bans import PeerBans
    from swarm.fabric.weights.chunked_fetch import SharerView
    from swarm.fabric.interface import JoinError
    from swarm.config.learner_keys import encode_learner_key
    from swarm.fabric.membership.pulse import Pulse
    from swarm.fabric.membership.records import Heartbeat
    from swarm.fabric.weights.announcements import RunSampling
    from swarm.fabric.transports import join_with
    from swarm.fabric.weights.versions import MAX_HELD_VERSIONS, VersionStore
    from swarm.intake import GroupIntake
    from swarm.model.device import resolve_device, resolve_dtype, torch_dtype
    from swarm.model.loading import load_policy
    from swarm.fabric.weights.delta import non_finite_tensors, state_hash
    from swarm.runlog import EventLog, StepLog, write_json_atomic, write_ready
    from swarm.signals import install_stop_signals
    from swarm.tasks import load_problems
    from swarm.fabric.rollouts.wire import WireLimits
    from swarm.training import LearnerCore, NonFiniteStep, NothingToStep, OutOfStep
    from swarm.verification import LogprobVerifier

    from swarm.progress import LineProgress

    stop = stop or threading.Event()
    progress = progress or LineProgress(echo)
    install_stop_signals(stop)
    run_dir, resume_from = check_run_dir(config)
    torch.manual_seed(config.seed)

    device = resolve_device(config.device)
    # float32 master weights and optimizer state always; bfloat16 runs forward and backward under
    # autocast, and versions are published in it (what GPU samplers run, half the bytes)
    dtype = resolve_dtype(config.dtype, device)
    publish_dtype = torch_dtype(dtype)

    def build_learner(model, tokenizer) -> LearnerCore:
        return LearnerCore.from_settings(model.to(device), tokenizer.pad_token_id, config,
                                         autocast_dtype=publish_dtype if dtype != "float32" else None)

    if resume_from:
        events = EventLog(run_dir)

        def warn(message: str) -> None:
            events.event("damaged_checkpoint", message=message)
            echo(f"warning: {message}")

        resume_from, core, tokenizer = load_verified(run_dir, build_learner, warn=warn)
        model, core.version = core.model, resume_from.version
    else:
        model, tokenizer = load_policy(config.model)  # a bad --model fails here, before anything is made
        core = build_learner(model, tokenizer)
    answers = {p.problem_id: p.answer for p in load_problems(config.task, config.task_options(), tokenizer=tokenizer)}
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    fabric = dashboard = None
    try:  # a start that fails (no swarm, a port taken) leaves no half-made run directory
        write_config(config, run_dir / "config.yaml")
        if not resume_from:
            events = EventLog(run_dir)
        fabric = join_with(config, "learner")
        team = join_team(config, fabric, core, events, echo)
        if team is not None and team.joining and not team.wait_for_others(3 * fabric.heartbeat_s + 5):
            echo(f"no other learner of run '{config.run_id}' is up: this one starts it")  # an offline owner's first learner
        elif team is not None and team.joining:  # one more learner: the run's state first, then its versions
            echo(f"joining run '{config.run_id}' as one more learner: downloading the state of a running learner")
            if not team.catch_up(max(60.0, 2 * config.averaging_timeout_s), beat_s=fabric.heartbeat_s, beat=lambda: fabric.heartbeat(
                    Heartbeat(role="learner", model=config.model, version=core.version, certificate=fabric.certificate))):
                raise JoinError(f"no learner of run '{config.run_id}' served its state; check that the run owner's learner "
                                "is running and reachable through --peers, and that --certificate was issued for this run")
        if resume_from:
            own = fabric.latest_announced([fabric.public_key])
            newest = max(v for v in (published_version(run_dir), own.version if own else None, resume_from.version) if v is not None)
            if newest > resume_from.version:
                echo(f"checkpoint is at version {resume_from.version} but {newest} was published; its weights continue as version {newest + 1}")
                core.version = newest + 1
            echo(f"resumed from {resume_from.path}")
            events.event("resumed", checkpoint=str(resume_from.path), version=core.version)
        store = VersionStore(capacity=max(8, min(config.max_staleness, MAX_HELD_VERSIONS) + 1))
        server = fabric.weight_server(store)
        # the ids a policy can emit: its output layer's rows, which models pad past the tokenizer
        # (Qwen3: 151,936 rows for 151,669 tokens), so an honest sampler may draw a padding id
        vocab = max(len(tokenizer), model.get_output_embeddings().weight.shape[0])
        inbox = fabric.rollout_inbox(vocab_size=vocab, max_staleness=config.max_staleness,
                                     # a short queue: backpressure holds samplers back instead of
                                     # letting a backlog of old groups raise staleness
                                     capacity=config.groups_per_step * 2,
                                     bans=PeerBans(config.ban_after, config.ban_window_s, config.ban_s),
                                     limits=WireLimits.for_run(getattr(model.config, "max_position_embeddings", None),
                                                               config.max_completion_length))
        verifier = LogprobVerifier(model, store.states, lock=store.lock, pad_token_id=tokenizer.pad_token_id,
                                   fraction=config.verify_fraction, tolerance=config.verify_tolerance, seed=config.seed)
        intake = GroupIntake(answers, decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
                             stop_strings=config.stop_strings,
                             max_staleness=config.max_staleness, max_age_s=config.max_age_s, penalize=inbox.penalize,
                             temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, verifier=verifier,
                             banned=lambda peer: inbox.bans.remaining(peer) > 0)
        learner_key = encode_learner_key(fabric.public_key)
        # samplers pin the run's owner key: this learner's own, or the one that certified it
        run_key = encode_learner_key(team.owner) if team is not None else learner_key
        (run_dir / "learner.key").write_text(run_key + "\n")  # for `swarm sampler --learner-key-file`
        # --dashboard-port: the swarm as this learner's own fabric reads it
        dashboard = peer_dashboard(config, fabric, run_dir=run_dir, announcements_from="this run's learner key",
                                   learner_keys=[team.owner if team is not None else fabric.public_key])
        write_ready(run_dir, role="learner", run_id=config.run_id, transport=fabric.transport, peer_id=fabric.peer_id,
                    addresses=fabric.addresses(), learner_key=run_key, own_key=learner_key,
                    owner_key_file=str(fabric.signing_key_path) if fabric.signing_key_path and run_key == learner_key else None,
                    **({"dashboard": dashboard.url} if dashboard else {}))
    except BaseException:
        if dashboard is not None:
            dashboard.close()
        if fabric is not None:  # its DHT and averager processes would outlive this one
            fabric.shutdown()
        if made:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    echo(f"learner {fabric.peer_id} for run '{config.run_id}' ({fabric.transport}), run directory {run_dir}")
    echo(f"samplers join with: --learner-key {run_key}")
    if dashboard is not None:
        echo(f"dashboard of run '{config.run_id}' at {dashboard.url}")
    for addr in fabric.addresses():
        echo(f"  --peers {addr}")

    totals = {"used": 0, "tokens_per_s": 0.0, "skipped_steps": 0, "gap_warnings": 0}
    # for its record (`swarm status` flags a learner that stops stepping): when it last stepped, and
    # the seconds between its recent steps
    last_step, step_times = time.time(), deque(maxlen=STEP_TIMES_KEPT)
    sampling = RunSampling(config.temperature, config.top_k, config.top_p, config.max_completion_length,
                           tuple(config.stop_strings))

    def heartbeat() -> None:
        with store.lock:
            version = store.latest
            digest, holds, recent = store.hashes[version], tuple(store.states), dict(store.hashes)
        chunks = store.chunk_specs(version, quick=True)
        fabric.announce(version, digest, sampling, recent, chunks, sharers.announced(version, chunks))
        fabric.heartbeat(Heartbeat(role="learner", model=config.model, model_hash=digest[:16], version=version,
                                   rollouts=totals["used"], tokens_per_s=totals["tokens_per_s"], holds=holds,
                                   certificate=getattr(fabric, "certificate", ""), heartbeat_s=fabric.heartbeat_s,
                                   step_s=statistics.median(list(step_times)) if step_times else 0.0,
                                   since_step_s=time.time() - last_step))
        if team is not None:
            team.refresh(start=False)  # lets new learners in; the training loop starts averaging
        if pulse is not None and store.snapshot_due(version):
            store.chunk_specs(version)  # the snapshot's, for new samplers: announced at the next beat, at once
            pulse.poke()

    def publish() -> None:
        state = {k: (v.detach().to(publish_dtype) if v.is_floating_point() else v.detach()) for k, v in model.state_dict().items()}
        bad = non_finite_tensors(state)
        if bad:  # cannot happen after a finite step; if it does, nothing of it leaves this process
            raise RuntimeError(f"version {core.version} holds non-finite weights ({', '.join(bad[:3])}); not published. "
                               f"Resume from the last checkpoint in {run_dir / 'checkpoints'} with a lower --learning-rate")
        sharers.publishing(core.version)  # who fetches its delta, looked up while it is encoded
        store.add(core.version, state)
        # atomic: a torn file would let a resumed learner announce an older version number
        write_json_atomic(run_dir / "published.json", {"version": core.version, "hash": store.hashes[core.version]})
        inbox.learner_version = core.version  # before announcing: groups at the new version are welcome
        if pulse is None:
            heartbeat()  # the first version is announced before anything else happens
        else:
            pulse.poke()  # announce from the heartbeat thread: a slow swarm never holds up training

    def master_hash() -> str:
        """The hash of the float32 weights a checkpoint holds (what --resume checks them against);
        the published version's own hash when it is published in float32."""
        if dtype == "float32":
            return store.hashes[core.version]
        return state_hash({k: v.detach().cpu() for k, v in model.state_dict().items()})

    def checkpoint() -> None:
        try:
            path = save_checkpoint(run_dir, model, tokenizer, core.optimizer, version=core.version,
                                   digest=master_hash(), config=json.loads(config.model_dump_json()),
                                   keep=config.keep_checkpoints, progress=progress)
        except OSError as exc:  # a full disk: say so, train on in memory, try again at the next checkpoint
            events.event("checkpoint_failed", version=core.version, error=str(exc))
            echo(f"warning: checkpoint of version {core.version} failed ({exc}); training goes on, the next checkpoint retries")
            return
        events.event("checkpoint", version=core.version, path=str(path))
        echo(f"checkpoint: {path}")

    # who fetches each new delta, named in its announcement (chunked_fetch.SharerView)
    sharers = SharerView(fabric)
    pulse = None
    publish()
    # announcements and the membership record on their own schedule: a step longer than a record's
    # life (any real LLM's) no longer takes the learner out of the listing
    pulse = Pulse(heartbeat, fabric.heartbeat_s, name="learner-heartbeat")
    from swarm.reporting import Reporter

    reporter = Reporter(run_dir, config.report_to, config=config.model_dump(mode="json"))
    steps = StepLog(run_dir, on_write=reporter.step)
    last_step = time.time()
    try:
        while core.version < config.steps and not stop.is_set():
            # several learners: each gathers its share of the run's batch, and goes to the round in time
            learners = team.refresh() if team is not None else 1
            share = max(1, math.ceil(config.groups_per_step / learners))
            gather_s = min(config.wait_s, config.averaging_timeout_s / 2) if learners > 1 else config.wait_s
            batch, deadline = [], time.time() + gather_s
            while len(batch) < share and time.time() < deadline and not stop.is_set():
                group = inbox.get(timeout=1.0)
                if group is not None and intake.accept(group, core.version):
                    batch.append(group)
            if not batch and team is not None and team.group is not None and not stop.is_set():
                try:  # no groups here: take the others' step all the same, so as to stay in step
                    metrics = core.step_with_group()
                except NothingToStep:
                    metrics = None
                except OutOfStep as exc:
                    events.event("out_of_step", version=core.version, reason=str(exc))
                    echo(f"out of step with the other learners ({exc}); downloading the run's state")
                    if team.catch_up(2 * config.averaging_timeout_s):
                        publish()
                    continue
                if metrics is not None:
                    publish()
                    steps.step(metrics, seconds=time.time() - last_step, used_total=totals["used"], team=dict(team.stats),
                               weights_hash=store.hashes[core.version])
                    step_times.append(time.time() - last_step)
                    last_step = time.time()
                    echo(f"step {core.version}: on the other learners' groups only")
                    continue
            if not batch:
                if not stop.is_set():
                    events.event("waiting", seconds=round(gather_s, 1), version=core.version)
                    echo(f"no rollouts for {gather_s:.0f}s; waiting for samplers")
                continue
            try:
                metrics = core.step(batch)
            except NonFiniteStep as exc:  # nothing changed: count it and train on the next batch
                totals["skipped_steps"] += 1
                events.event("skipped_step", version=core.version, reason=str(exc), groups=len(batch))
                echo(f"warning: {exc}")
                continue
            except OutOfStep as exc:  # another learner is ahead or holds other weights: take the run's state
                events.event("out_of_step", version=core.version, reason=str(exc))
                echo(f"out of step with the other learners ({exc}); downloading the run's state")
                if team.catch_up(2 * config.averaging_timeout_s):
                    publish()
                continue
            totals["used"] += len(batch)
            totals["tokens_per_s"] = metrics["completion_tokens"] / max(metrics["optimizer_seconds"], 1e-6)
            publish()
            steps.step(metrics, seconds=time.time() - last_step, used_total=totals["used"], dropped=dict(intake.dropped),
                       weights_hash=store.hashes[core.version],
                       inbox_refused=dict(inbox.stats.reasons), banned=inbox.bans.banned(),
                       skipped_steps=totals["skipped_steps"], verified=verifier.checked,
                       verify_seconds=round(verifier.seconds, 4), largest_honest_gap=verifier.largest_honest_gap,
                       uploads=server.served, uploaded_bytes=server.bytes_served, uploads_refused_busy=server.slots.refused,
                       **({"team": dict(team.stats)} if team is not None else {}))
            step_times.append(time.time() - last_step)
            last_step = time.time()
            echo(f"step {core.version}: reward {metrics['reward_mean']:.3f}, staleness {metrics['staleness_mean']:.1f} "
                 f"(max {metrics['staleness_max']:.0f}), {len(batch)} groups, dropped {dict(intake.dropped)}")
            gap = metrics["fresh_logprob_gap"]
            if gap == gap and gap > config.fresh_gap_warning:  # NaN: no fresh group this step
                totals["gap_warnings"] += 1
                events.event("logprob_gap", version=core.version, gap=gap, threshold=config.fresh_gap_warning)
                if totals["gap_warnings"] in (1, 10) or totals["gap_warnings"] % 100 == 0:
                    echo(f"warning: samplers' log-probs differ from the learner's by {gap:.3f} per token on groups of the "
                         f"current version (threshold {config.fresh_gap_warning:g}): a sampler may not be running the "
                         "weights it claims (a failed weight update), or runs another precision or model")
            if config.checkpoint_every and core.version % config.checkpoint_every == 0:
                checkpoint()
        checkpoint()  # at exit, also on Ctrl-C / SIGTERM
    except Exception as exc:
        # progress since the last checkpoint is not lost to a crash: save what is sound, then fail
        events.event("crashed", version=core.version, error=f"{type(exc).__name__}: {exc}")
        if core.version in store.hashes:  # the current version was published, so it is finite
            checkpoint()
        raise
    finally:
        pulse.close()
        sharers.close()
        if team is not None:
            team.close()
        steps.close()
        reporter.close()
        inbox.close()
        server.close()
        intake.close()
        if dashboard is not None:
            dashboard.close()  # before the fabric it reads
        fabric.shutdown()
        result = {"version": core.version, "used": totals["used"], "dropped": dict(intake.dropped), "run_dir": str(run_dir),
                  "refused": dict(inbox.stats.reasons), "banned": inbox.bans.banned(), "skipped_steps": totals["skipped_steps"]}
        events.event("stopped", **result)
        events.close()
    return result
