"""A hostile sampler, run as its own process by the fault tests: it joins the swarm like a real
sampler, with its own identity, and sends the learner correctly signed and shaped groups that
attack it (--attack):

- forge:  garbage frames, and groups whose rewards are forged (wrong answers claimed correct);
- lie:    right answers with behaviour log-probs far below what the policy gives them (to inflate
          their importance weights);
- prompt: real problem ids with another problem's prompt or an invented one, and the id's gold
          answer as the completions, with honest log-probs (issue 45, attack 1);
- replay: one honest group, sent again and again under fresh ids (issue 45, attack 2);
- noisy:  honest groups, one of them with every log-prob 0.15 off: an honest sampler's worst day
          (issue 45, attack 8: refused, never banned);
- steer:  completions of a wrong answer, honestly scored 0, claiming log-prob 0 for every token,
          to steer the step through the KL penalty (issue 45, attack 9).

Honest groups are sampled by the project's own code (TransformersBackend, produce_rollouts) from
the embedded policy, which is the learner's version 0, with the run's announced sampling settings;
so they carry true log-probs at version 0 and pass every check. Each ack it gets back is written
as a JSON line to --out, after a first line naming its peer id.
"""

import argparse
import copy
import json
import time
from pathlib import Path

ATTACKS = ("forge", "lie", "prompt", "replay", "noisy", "steer")
INVENTED_PROMPT = "Say the number forty-two. Answer in \\boxed{}.\n"
NOISE = 0.15  # over the learner's 0.1 tolerance, as an honest excursion might be
UNLIKELY_WRONG = "\\boxed{x^2 + 7}"  # wrong, 16 tokens with EOS (the test run's longest), token log-probs down to -14.4


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


class Attacker:
    """Builds the groups of one attack from the embedded policy (the learner's version 0)."""

    def __init__(self, attack: str, announcement) -> None:
        from swarm.generation import SamplingParams
        from swarm.generation.transformers_backend import TransformersBackend
        from swarm.model.loading import load_policy
        from swarm.tasks.synthetic import ArithmeticTask

        self.attack = attack
        self.model, self.tokenizer = load_policy("embedded")
        self.problems = ArithmeticTask(2).problems("train")
        self.ann = announcement
        run = announcement.sampling  # the run's sampling settings, as a real sampler takes them
        self.params = SamplingParams(num_completions=4, temperature=run.temperature, top_k=run.top_k, top_p=run.top_p,
                                     max_new_tokens=min(run.max_tokens, 16), stop_strings=list(run.stop))
        self.backend = TransformersBackend(self.model, self.tokenizer)
        self.replayed = None

    def honest(self, problem):
        """A group sampled and scored as a real sampler does it, at version 0."""
        from swarm.rewards import RewardScorer
        from swarm.sampling import produce_rollouts

        scorer = RewardScorer()
        try:
            return produce_rollouts(self.backend, scorer, [problem], self.params, version=0, sampler_id="honest-looking")[0]
        finally:
            scorer.close()

    def true_logprobs(self, prompt_ids, completions) -> list[list[float]]:
        """The embedded policy's log-probs of `completions` after `prompt_ids`: what version 0 gives."""
        import torch

        from swarm.logprobs import completion_logprobs
        from swarm.rollouts import RolloutGroup, collate

        group = RolloutGroup(problem_id="x", prompt_ids=prompt_ids, completion_ids=completions,
                             sampler_logprobs=[[0.0] * len(c) for c in completions], rewards=[0.0] * len(completions),
                             version=0, sampler_id="x")
        batch = collate([group], self.tokenizer.pad_token_id)
        with torch.no_grad():
            lps = completion_logprobs(self.model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                      temperature=self.params.temperature, top_k=self.params.top_k, top_p=self.params.top_p)
        return [lps[i, : len(c)].tolist() for i, c in enumerate(completions)]

    def groups(self, i: int) -> list:
        from swarm.rollouts import RolloutGroup

        problem, tok, version = self.problems[i], self.tokenizer, self.ann.version
        if self.attack == "forge":
            return [forged_group(problem, tok, version)]
        if self.attack == "lie":
            return [lying_group(problem, tok, version)]
        if self.attack == "replay":
            self.replayed = self.replayed or self.honest(self.problems[0])
            return [copy.deepcopy(self.replayed)]  # the wire gives each send a fresh id
        if self.attack == "noisy":
            group = self.honest(problem)
            if i == 1:
                group.sampler_logprobs = [[x - NOISE for x in lp] for lp in group.sampler_logprobs]
            return [group]
        if self.attack == "prompt":
            text = self.problems[i + 1].prompt if i % 2 == 0 else INVENTED_PROMPT  # another problem's, or invented
            right = tok(f"\\boxed{{{problem.answer}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            prompt_ids = tok(text)["input_ids"]
            completions = [right] * self.params.num_completions
            return [RolloutGroup(problem_id=problem.problem_id, prompt_ids=prompt_ids, completion_ids=completions,
                                 sampler_logprobs=self.true_logprobs(prompt_ids, completions), rewards=[1.0] * len(completions),
                                 version=0, sampler_id="honest-looking", temperature=self.params.temperature,
                                 top_k=self.params.top_k, top_p=self.params.top_p)]
        if self.attack == "steer":
            wrong = tok(UNLIKELY_WRONG, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            completions = [wrong] * self.params.num_completions
            return [RolloutGroup(problem_id=problem.problem_id, prompt_ids=tok(problem.prompt)["input_ids"],
                                 completion_ids=completions, sampler_logprobs=[[0.0] * len(wrong)] * len(completions),
                                 rewards=[0.0] * len(completions), version=0, sampler_id="honest-looking",
                                 temperature=self.params.temperature, top_k=self.params.top_k, top_p=self.params.top_p)]
        raise ValueError(f"unknown attack {self.attack!r}; one of {', '.join(ATTACKS)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", required=True)
    parser.add_argument("--learner-key", required=True)
    parser.add_argument("--identity-dir", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--transport", default="hivemind")
    parser.add_argument("--attack", choices=ATTACKS, default="forge")
    parser.add_argument("--lie", action="store_true", help="the same as --attack lie")
    parser.add_argument("--every-s", type=float, default=1.0, help="seconds between rounds")
    args = parser.parse_args()

    from swarm.config.learner_keys import decode_learner_key
    from swarm.fabric.transports import join

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
        attacker = Attacker("lie" if args.lie else args.attack, ann)
        out.write(json.dumps({"peer_id": fabric.peer_id}) + "\n")  # who we are, for the test to look up
        for i in range(args.rounds):
            attacker.ann = fabric.latest_announced([decode_learner_key(args.learner_key)]) or attacker.ann
            try:
                acks = sender.send_frames(ann.peer_id, [b"\x93garbage"]) if attacker.attack == "forge" else []
                acks += sender.send(ann.peer_id, attacker.groups(i))
            except Exception as exc:  # noqa: BLE001  the learner finished and left
                print(f"learner gone: {type(exc).__name__}", flush=True)
                break
            for ack in acks:
                out.write(json.dumps(ack) + "\n")
            out.flush()
            time.sleep(args.every_s)
    finally:
        out.close()
        sender.close()
        fabric.shutdown()
    print("bad sampler done", flush=True)


if __name__ == "__main__":
    main()
