"""Several learners of one LoRA run, as real processes on loopback (a bootstrap node, two learners,
a sampler): they average the adapter's gradients alone and publish the same adapter at every
version; a learner of another rank is refused before it joins, with a message naming what the run
trains and what to start it with (another base is the same comparison of the announced adapter,
hash included: `Learner._check_run_adapter`; a sampler over another base is refused in
test_lora_run.py). Kept small (the embedded policy, a
few steps): tests/fabric/hivemind/test_learners.py covers kills and late joiners at length."""

import os
import signal
import subprocess
import sys
import time


from swarm.runlog import read_jsonl, wait_ready
from tests.helpers.certificates import certificate
from tests.helpers.processes import kill_tree

SWARM = [sys.executable, "-m", "swarm.cli"]
LORA = ["--lora-r", "4", "--lora-alpha", "8"]
LEARNER = ["--steps", "1000", "--groups-per-step", "2", "--checkpoint-every", "0", "--max-completion-length", "12",
           "--averaging-timeout-s", "20"]


def test_lora_learners_average_the_adapter_alone_and_refuse_another_rank(tmp_path):
    from swarm.config.settings import LORA_TARGET_MODULES
    from swarm.lora import wrap_lora
    from swarm.model.loading import load_policy

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs, logs = {}, {}

    def spawn(name, *args):
        logs[name] = tmp_path / f"{name}.log"
        with logs[name].open("w") as log:
            procs[name] = subprocess.Popen([*SWARM, *args], stdout=log, stderr=subprocess.STDOUT, env=env, text=True)

    def tail(name=None):
        return "\n".join(f"--- {n}\n{logs[n].read_text()[-2500:]}" for n in ([name] if name else logs))

    def ready(name):
        found = wait_ready(tmp_path / name, timeout_s=180, alive=lambda: procs[name].poll() is None)
        assert found is not None, tail(name)
        return found

    def wait_for(condition, timeout_s, what):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if condition():
                return
            dead = [n for n in ("boot", "owner", "sampler", "second") if n in procs and procs[n].poll() is not None]
            assert not dead, f"{dead} stopped while waiting for {what}\n{tail()}"
            time.sleep(0.2)
        raise AssertionError(f"{what} within {timeout_s}s\n{tail()}")

    def events(name, kind):
        path = tmp_path / name / "events.jsonl"
        return [e for e in read_jsonl(path) if e["event"] == kind] if path.exists() else []

    def steps(name):
        path = tmp_path / name / "steps.jsonl"
        return read_jsonl(path) if path.exists() else []

    def certified(name):
        """A learner's arguments with the owner's certificate for its key."""
        identity = tmp_path / f"{name}-id"
        return ["--run-dir", str(tmp_path / name), "--identity-dir", str(identity),
                "--certificate", certificate(identity, owner["owner_key_file"])]

    # the adapter's size on this model (the learners' default targets)
    adapter_elements = sum(p.numel() for p in wrap_lora(load_policy("embedded")[0], r=4, alpha=8,
                                                         target_modules=LORA_TARGET_MODULES).parameters() if p.requires_grad)
    try:
        spawn("boot", "bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "boot.key"),
              "--run-dir", str(tmp_path / "boot"))
        addr = ready("boot")["addresses"][0]
        spawn("owner", "learner", "--peers", addr, "--run-dir", str(tmp_path / "owner"), "--identity-dir",
              str(tmp_path / "owner-id"), *LORA, *LEARNER)
        owner = ready("owner")
        spawn("sampler", "sampler", "--peers", addr, "--learner-key-file", str(tmp_path / "owner" / "learner.key"),
              "--prompts-per-round", "2", "--num-generations", "4", "--identity-dir", str(tmp_path / "sampler-id"),
              "--run-dir", str(tmp_path / "sampler"))
        # the run's adapter is in the owner's signed announcements once it has published a version
        joiners = {name: certified(name) for name in ("second", "rank8")}
        ready("sampler")
        wait_for(lambda: events("owner", "published"), 120, "the owner's first version")
        spawn("second", "learner", "--peers", addr, *joiners["second"], *LORA, *LEARNER)
        spawn("rank8", "learner", "--peers", addr, *joiners["rank8"], "--lora-r", "8", "--lora-alpha", "8", *LEARNER)

        assert procs["rank8"].wait(timeout=240) != 0, tail("rank8")
        said = " ".join(logs["rank8"].read_text().split())
        assert "run 'swarm' trains LoRA r=4, alpha=8" in said and "this learner LoRA r=8" in said, tail("rank8")
        assert said.count("over base ") == 2 and "start it with the run's --model and --lora-r" in said, tail("rank8")
        assert not steps("rank8") and not events("rank8", "learner_group"), tail("rank8")

        # the two learners average the adapter's gradients (its elements, not the model's) and
        # publish the same adapter at every version both published
        def published(name):
            return {e["version"]: e["hash"] for e in events(name, "published")}

        def averaged(name):  # versions made in a step on the group's mean gradient (one alone, when a
            # round times out with both present, may publish a number under other weights: see test_learners)
            return {int(s["step"]) for s in steps(name) if s.get("learners", 1.0) >= 2.0}

        def common_averaged():
            return set(published("owner")) & set(published("second")) & averaged("owner") & averaged("second")

        def together():
            return len([s for s in steps("second") if s.get("learners") == 2.0]) >= 2 and len(common_averaged()) >= 2

        wait_for(together, 300, "two learners stepping together on two versions")
        assert [e["elements"] for n in ("owner", "second") for e in events(n, "learner_group")][:2] == [adapter_elements] * 2
        common = sorted(common_averaged())
        assert all(published("owner")[v] == published("second")[v] for v in common), common
        stopping = time.time()
        for name in ("owner", "second"):
            procs[name].send_signal(signal.SIGTERM)
        for name in ("owner", "second"):
            assert procs[name].wait(timeout=120) == 0, tail(name)
        # stopped together: one still looking for its group reads the other's leaving record and
        # steps alone, rather than waiting out the round's 20 s for a learner that has gone
        alone = [e for n in ("owner", "second") for e in events(n, "averaging_alone") if e["time"] > stopping]
        assert all("every other learner left" in e["reason"] for e in alone), alone
    finally:
        for proc in procs.values():  # each with its DHT process and p2p daemon
            if proc.poll() is None:
                kill_tree(proc.pid)
