"""Issue 45's hostile samplers against a real learner process, over both transports: four hostile
sampler processes (tests/helpers/bad_sampler.py), each with its own signing identity, send
correctly signed and shaped groups at once:

- prompt: real problem ids with another problem's or an invented prompt: all refused, struck;
- replay: one honest group under fresh ids: trained on once, every copy refused by content;
- noisy:  honest groups, one 0.15 off: that one refused, the sampler never banned, the rest trained on;
- steer:  wrong answers claiming log-prob 0: refused, and banned at its second checked group.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.runlog import read_jsonl
from tests.peers.test_faults import swarm  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
ROUNDS = 4
BAD_SAMPLER = Path(__file__).parents[1] / "helpers" / "bad_sampler.py"


def replies(path: Path) -> tuple[str, list[dict]]:
    header, *acks = [json.loads(line) for line in path.read_text().splitlines()]
    return header["peer_id"], acks


@pytest.mark.parametrize("transport", ["hivemind", "grpc"])
def test_hostile_samplers_are_refused_and_only_the_liar_is_banned(swarm, tmp_path, transport):  # noqa: F811
    swarm.transport = transport
    run_dir = tmp_path / "learner"
    addr = swarm.start_bootstrap()
    # every group checked, so that the counts are exact (the check rate's own odds: benchmarks/ban_rate.py)
    learner, key = swarm.start_learner(addr, "--steps", "1000", "--groups-per-step", "4", "--checkpoint-every", "0",
                                       "--verify-fraction", "1", run_dir=run_dir)
    attacks = ("prompt", "replay", "noisy", "steer")
    procs = {}
    try:
        for attack in attacks:
            acks = tmp_path / f"{attack}-acks.jsonl"
            procs[attack] = (acks, subprocess.Popen(
                [sys.executable, str(BAD_SAMPLER), "--peers", addr, "--learner-key", key, "--run-id", swarm.run_id,
                 "--identity-dir", str(tmp_path / "keys" / attack), "--rounds", str(ROUNDS), "--out", str(acks),
                 "--transport", transport, "--attack", attack],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for attack, (_, proc) in procs.items():
            out, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"{attack}: {out}"
        every = {attack: replies(acks) for attack, (acks, _) in procs.items()}
        delivered = sum(ack.get("ok", False) for _, acks in every.values() for ack in acks)
        refused_unread = sum(not ack.get("ok", False) for _, acks in every.values() for ack in acks)

        time.sleep(3.0)  # the intake takes a group in milliseconds; the last ones were sent a second ago
        assert swarm.stop(learner) == 0, learner.text()[-3000:]
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    result = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stopped"][-1]
    dropped, banned = result["dropped"], result["banned"]
    ids = {attack: every[attack][0] for attack in attacks}
    assert dropped.get("prompt not its problem's") == ROUNDS  # attack 1: every one, whatever its log-probs
    assert dropped.get("same content as an accepted group") == ROUNDS - 1  # attack 2: trained on once
    assert dropped.get("log-prob mismatch") == 1 + 2  # the noisy group, and the steerer's two checked groups
    assert ids["steer"] in banned and not {ids["noisy"], ids["prompt"], ids["replay"]} & set(banned)
    assert any("banned" in ack.get("reason", "") for ack in every["steer"][1]) or dropped.get("sender banned", 0) >= 1
    assert result["used"] == 1 + (ROUNDS - 1)  # the replay's first; the noisy sampler's honest groups
    assert delivered + refused_unread == 4 * ROUNDS and refused_unread == ROUNDS - 2 - dropped.get("sender banned", 0)
