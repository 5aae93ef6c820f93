"""A misbehaving sampler, run as its own process by the fault tests: it joins the swarm like a
real sampler and sends the learner garbage frames and rollout groups whose rewards are forged
(wrong answers claimed correct), or with --lie, right answers with behaviour log-probs far below
what the policy gives them (to inflate their importance weights). Each ack it gets back is
written as a JSON line to --out."""

import argparse
import json
import time
from pathlib import Path


def forged_group(problem, tokenizer, version: int, size: int = 4):
    from swarm.rollouts import RolloutGroup

    wrong = f"\\boxed{{{int(problem.answer) + 1}}}"  # scorable, and wrong
    ids = tokenizer(wrong, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return RolloutGroup(problem_id=problem.problem_id, prompt_ids=tokenizer(problem.prompt)["input_ids"],
                        completion_ids=[ids] * size, sampler_logprobs=[[-1.0] * len(ids)] * size, rewards=[1.0] * size,
                        version=version, sampler_id="honest-looking-sampler", completion_texts=[wrong] * size)


def lying_group(problem, tokenizer, version: int, size: int = 4):
    """Right answers, correctly rewarded, claiming log-prob -20 for every token."""
    from swarm.rollouts import RolloutGroup

    right = f"\\boxed{{{problem.answer}}}"
    ids = tokenizer(right, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return RolloutGroup(problem_id=problem.problem_id, prompt_ids=tokenizer(problem.prompt)["input_ids"],
                        completion_ids=[ids] * size, sampler_logprobs=[[-20.0] * len(ids)] * size, rewards=[1.0] * size,
                        version=version, sampler_id="honest-looking-sampler", completion_texts=[right] * size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", required=True)
    parser.add_argument("--learner-key", required=True)
    parser.add_argument("--identity-dir", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--transport", default="hivemind")
    parser.add_argument("--lie", action="store_true", help="send right answers with made-up log-probs instead")
    args = parser.parse_args()

    from swarm.config.learner_keys import decode_learner_key
    from swarm.fabric.transports import join
    from swarm.model.loading import load_policy
    from swarm.tasks.synthetic import ArithmeticTask

    _, tokenizer = load_policy("embedded")
    problems = ArithmeticTask(2).problems("train")
    fabric = join(args.transport, run_id=args.run_id, peers=[args.peers], role="sampler", identity_dir=Path(args.identity_dir))
    sender = fabric.rollout_sender()
    out = Path(args.out).open("w")
    try:
        ann = None
        for _ in range(120):
            ann = fabric.latest_announced([decode_learner_key(args.learner_key)])
            if ann:
                break
            time.sleep(0.5)
        if ann is None:
            raise SystemExit("bad sampler: no learner announcement within 60 s")
        print(f"bad sampler {fabric.peer_id} found learner {ann.peer_id}", flush=True)
        out.write(json.dumps({"peer_id": fabric.peer_id}) + "\n")  # who we are, for the test to look up
        for i in range(args.rounds):
            ann = fabric.latest_announced([decode_learner_key(args.learner_key)]) or ann
            try:
                if args.lie:
                    acks = sender.send(ann.peer_id, [lying_group(problems[i], tokenizer, ann.version)])
                else:
                    acks = sender.send_frames(ann.peer_id, [b"\x93garbage"])
                    acks += sender.send(ann.peer_id, [forged_group(problems[i], tokenizer, ann.version)])
            except Exception as exc:  # noqa: BLE001  the learner finished and left
                print(f"learner gone: {type(exc).__name__}", flush=True)
                break
            for ack in acks:
                out.write(json.dumps(ack) + "\n")
            out.flush()
            time.sleep(1.0)
    finally:
        out.close()
        sender.close()
        fabric.shutdown()
    print("bad sampler done", flush=True)


if __name__ == "__main__":
    main()
