"""The swarm's peers: the middle layer. Each is a thin loop over library objects (`swarm`), and
each writes what tools need to its run directory (ready.json, JSONL metrics and events); the CLI
(`swarm.cli`) starts them. Nothing in the library imports this package.

- learner.py  - class Learner (run_learner): trains on samplers' rollouts, publishes versions,
                checkpoints and resumes.
- sampler.py  - class Sampler (run_sampler): generates and scores rollouts with the newest version
                it may use, follows versions.
- lifecycle.py - class Peer, what the learner and the sampler share: set up, main loop, and one
                teardown that closes what was opened, newest first (also after a failed start).
- trainer.py  - the in-process trainer: learner and virtual samplers in one process, staleness
                drawn from a delay distribution (the demo's --in-process mode, the staleness study).

The bootstrap node is the top-level package `bootstrap/`.
"""
