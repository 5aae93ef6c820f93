"""--max-prompt-length: prompts cut from the left to their last N tokens (TRL's behaviour), in the one
place prompts are built, so that the learner's problems hold the very prompts samplers generate from."""

import json

import pytest

from swarm.config import LearnerConfig, SamplerConfig
from swarm.config.learner_keys import encode_learner_key
from swarm.model.loading import load_policy
from swarm.tasks import load_problems, load_task

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"


@pytest.fixture(scope="module")
def tokenizer():
    return load_policy("embedded")[1]


def test_long_prompts_keep_their_last_tokens_and_every_role_builds_the_same(tmp_path, tokenizer):
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(json.dumps({"question": "blah " * (5 * i) + f"what is {i}+1?", "answer": str(i + 1)})
                              for i in range(1, 8)) + "\n")
    full = load_problems(str(path), LearnerConfig(task=str(path), peers=[PEER]).task_options(), tokenizer=tokenizer, split="all")
    limit = min(len(tokenizer(p.prompt, add_special_tokens=False)["input_ids"]) for p in full)  # the shortest fits
    common = dict(task=str(path), max_prompt_length=limit, peers=[PEER])
    learner = LearnerConfig(**common)
    sampler = SamplerConfig(**common, learner_keys=[encode_learner_key(b"[owner:k]")])
    assert learner.task_options() == sampler.task_options()
    cut = load_problems(learner.task, learner.task_options(), tokenizer=tokenizer, split="all")
    same = load_problems(sampler.task, sampler.task_options(), tokenizer=tokenizer, split="all")
    assert [p.prompt for p in cut] == [p.prompt for p in same]
    for short, whole in zip(cut, full):
        ids = tokenizer(whole.prompt, add_special_tokens=False)["input_ids"]
        assert len(tokenizer(short.prompt, add_special_tokens=False)["input_ids"]) <= limit
        if len(ids) > limit:  # cut from the left: the end, where the question and its instruction are, stays
            assert short.prompt == tokenizer.decode(ids[-limit:], skip_special_tokens=False) and short.prompt != whole.prompt
            assert whole.prompt.endswith(short.prompt.strip()[-10:])
        else:
            assert short.prompt == whole.prompt
    assert any(s.prompt != w.prompt for s, w in zip(cut, full)) and any(s.prompt == w.prompt for s, w in zip(cut, full))


def test_the_arithmetic_task_takes_it_too_and_needs_a_tokenizer(tokenizer):
    task = load_task("arithmetic", tokenizer=tokenizer, max_prompt_length=4)
    assert all(len(tokenizer(p.prompt, add_special_tokens=False)["input_ids"]) <= 4 for p in task.problems("test")[:20])
    with pytest.raises(ValueError, match="--max-prompt-length counts the policy's tokens"):
        load_task("arithmetic", max_prompt_length=4).problems("test")
