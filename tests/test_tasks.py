"""Tasks: the built-in arithmetic task and the datasets loader on real local files."""

import json

import pytest

from swarm.rewards import accuracy_reward
from swarm.tasks import load_task, shard_for_sampler
from swarm.tasks.synthetic import ArithmeticTask


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_arithmetic_gold_answers_verify_and_splits_are_disjoint(difficulty):
    task = ArithmeticTask(difficulty, size=300)
    train, test = task.problems("train"), task.problems("test")
    assert train and test
    assert not {p.question for p in train} & {p.question for p in test}
    for p in train[:50]:
        assert "\\boxed{}" in p.prompt
        assert accuracy_reward(f"\\boxed{{{p.answer}}}", p.answer) == 1.0
        assert accuracy_reward(f"\\boxed{{{int(p.answer) + 1}}}", p.answer) == 0.0
    assert ArithmeticTask(difficulty, size=300).problems("train") == train  # deterministic


def test_arithmetic_bad_difficulty_and_split():
    with pytest.raises(ValueError, match="difficulty must be 1..4"):
        ArithmeticTask(7)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        ArithmeticTask(2).problems("dev")


ROWS = [{"q": f"What is {i} plus {i}?", "a": str(2 * i), "extra": i} for i in range(40)]


def write_rows(tmp_path, fmt):
    import pandas as pd

    path = tmp_path / f"data.{fmt}"
    frame = pd.DataFrame(ROWS)
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "parquet":
        frame.to_parquet(path)
    elif fmt == "csv":
        frame.to_csv(path, index=False)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_dataset_loader_reads_every_local_format(tmp_path, fmt):
    path = write_rows(tmp_path, fmt)
    task = load_task(str(path), question_column="q", answer_column="a")
    problems = task.problems("train") + task.problems("test")
    assert len(problems) == len(ROWS)
    by_question = {p.question: p for p in problems}
    assert by_question["What is 7 plus 7?"].answer == "14"
    assert "What is 7 plus 7?" in by_question["What is 7 plus 7?"].prompt
    assert "\\boxed{}" in by_question["What is 7 plus 7?"].prompt


def test_dataset_answer_pattern_and_template(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"work...\n#### {i}"}) for i in range(10)))
    task = load_task(str(path), answer_pattern=r"####\s*(.+)", template="Q: {question}\nA:")
    problems = task.problems("train") + task.problems("test")
    assert sorted(p.answer for p in problems) == sorted(str(i) for i in range(10))
    assert all(p.prompt == f"Q: {p.question}\nA:" for p in problems)


def test_dataset_uses_tokenizer_chat_template(tmp_path):
    from swarm.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    path = write_rows(tmp_path, "jsonl")
    task = load_task(str(path), tokenizer=tok, question_column="q", answer_column="a")
    prompt = task.problems("train")[0].prompt
    assert prompt.startswith("<user>What is") and prompt.endswith("<assistant>")


def test_dataset_errors_name_the_problem(tmp_path):
    path = write_rows(tmp_path, "jsonl")
    with pytest.raises(ValueError, match="no question column 'question'.*'q'"):
        load_task(str(path)).problems()
    with pytest.raises(ValueError, match="no answer column 'solution'"):
        load_task(str(path), question_column="q", answer_column="solution").problems()
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        load_task(str(tmp_path / "missing.jsonl")).problems()
    empty = tmp_path / "empty.csv"
    empty.write_text("question,answer\n")
    with pytest.raises(ValueError, match="is empty"):
        load_task(str(empty)).problems()
    with pytest.raises(ValueError, match="unknown task 'gsm8k'"):
        load_task("gsm8k")


def test_sampler_shards_are_deterministic_and_disjoint():
    problems = ArithmeticTask(2, size=100).problems()
    a = shard_for_sampler(problems, "sampler-a", num_shards=3)
    assert a == shard_for_sampler(problems, "sampler-a", num_shards=3)
    shards = [shard_for_sampler(problems, f"s{i}", num_shards=3) for i in range(12)]
    union = {p.problem_id for s in shards for p in s}
    assert len(union) == 100
    order_a = shard_for_sampler(problems, "sampler-a")
    assert sorted(p.problem_id for p in order_a) == sorted(p.problem_id for p in problems)
    assert order_a != shard_for_sampler(problems, "sampler-b")
