"""The mid-size model (swarm/model/midsize.py) through the real peers: a bootstrap node, a learner in
bfloat16 and a sampler, each a process started by the launcher `swarm demo` uses, for three
steps. Records the step times, the versions the learner published, each version the sampler
fetched (kind, bytes, seconds), its swap pauses and the learner's fresh log-prob gap. The model is untrained: this measures the path, not
learning.

`python -m benchmarks midsize_peers`
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, write_result


def run() -> dict:
    from swarm.cli.launcher import LocalSwarm
    from swarm.model.midsize import midsize_model_dir
    from swarm.runlog import read_jsonl

    model = str(midsize_model_dir())
    root = Path(tempfile.mkdtemp(prefix="midsize-peers-"))
    swarm = LocalSwarm(root, run_id="midsize")
    started = time.time()
    try:
        addr = swarm.start_bootstrap()
        learner, key = swarm.start_learner(addr, "--model", model, "--steps", "3", "--groups-per-step", "2",
                                           "--checkpoint-every", "0", "--max-completion-length", "24", "--dtype", "bfloat16",
                                           run_dir=root / "learner")
        sampler = swarm.start_sampler("sampler-0", addr, key, "--model", model, "--num-generations", "4",
                                      "--prompts-per-round", "2", "--progress-every-s", "5")
        if learner.popen.wait(timeout=900) != 0:
            raise RuntimeError(f"the learner failed: {learner.text()[-2000:]}")
        steps = read_jsonl(root / "learner" / "steps.jsonl")
        events = read_jsonl(sampler.run_dir / "events.jsonl")
        learner_events = read_jsonl(root / "learner" / "events.jsonl")
    finally:
        swarm.stop_all()
        shutil.rmtree(root, ignore_errors=True)
    fetched = [e for e in events if e["event"] == "version_fetched"]
    figures = {
        "seconds": round(time.time() - started, 1),
        "steps": [{"version": int(s["version"]), "seconds": round(s["seconds"], 2), "fresh_logprob_gap": s["fresh_logprob_gap"]}
                  for s in steps],
        "fetched": [{"version": e["version"], "kinds": e["kinds"], "bytes": e["bytes"], "seconds": e["seconds"]} for e in fetched],
        "swap_seconds": [e["swap_seconds"] for e in events if e["event"] == "version_used"],
        # what the learner published (a CPU learner's encoding process, at idle priority, skips
        # versions rather than slow the steps); the sampler may not have fetched the last before the end
        "published": [e["version"] for e in learner_events if e["event"] == "published"],
    }
    markdown = (f"# The mid-size model through real peers\n\n{__doc__.strip()}\n\nWhole run: {figures['seconds']} s.\n\n"
                + markdown_table(["version", "step seconds", "fresh log-prob gap"],
                                 [[s["version"], s["seconds"], s["fresh_logprob_gap"]] for s in figures["steps"]])
                + "\n" + markdown_table(["version fetched", "kinds", "bytes", "seconds"],
                                        [[f["version"], ",".join(f["kinds"]), f["bytes"], f["seconds"]] for f in figures["fetched"]])
                + f"\nSampler swap pauses (s): {figures['swap_seconds']}\n"
                + f"\nVersions the learner published: {figures['published']}\n")
    write_result("midsize_peers", figures, markdown)
    return figures
