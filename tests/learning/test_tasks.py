"""Tasks: the built-in arithmetic task, the datasets loader on real local files (GSM8K- and MATH-shaped),
splits, task options, and hub names on a machine without the hub."""

import json
import re
import time
from pathlib import Path

import pytest

from swarm.rewards import accuracy_reward, score_one
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
    task = load_task(str(path), answer_pattern=r"####\s*(.+)", prompt_template="Q: {question}\nA:")
    problems = task.problems("train") + task.problems("test")
    assert sorted(p.answer for p in problems) == sorted(str(i) for i in range(10))
    assert all(p.prompt == f"Q: {p.question}\nA:" for p in problems)
    # a pattern without a group takes the whole match
    assert {p.answer for p in load_task(str(path), answer_pattern=r"\d+$").problems("all")} == {str(i) for i in range(10)}


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


# ---------------------------------------------------------------------------------------------
# Real datasets' shapes: GSM8K ("... #### 1,234") and MATH (\boxed{} inside a worked solution),
# from the small files in tests/data (written for these tests, in those datasets' formats)

DATA = Path(__file__).parents[1] / "data"
GSM8K = dict(answer_pattern=r"####\s*(.+)")
MATH = dict(question_column="problem", answer_column="solution")


def read_rows(name: str) -> dict[str, dict]:
    rows = [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines()]
    return {row.get("question", row.get("problem")): row for row in rows}


@pytest.fixture(scope="module")
def scorer():
    from swarm.rewards import RewardScorer

    scorer = RewardScorer([("accuracy", 1.0)])
    yield scorer
    scorer.close()


@pytest.mark.parametrize("name, options", [("gsm8k_style.jsonl", GSM8K), ("math_style.jsonl", MATH)])
def test_real_dataset_shapes_score_right_answers_1_and_wrong_ones_0(scorer, name, options):
    rows = read_rows(name)
    task = load_task(str(DATA / name), **options)
    problems = task.problems("all")
    # every MATH row has its \boxed{} answer; a GSM8K row without "####" has none
    answerable = {q for q, row in rows.items() if "solution" in row or "####" in row["answer"]}
    assert {p.question for p in problems} == answerable  # a row without "####" is left out, and counted
    assert task.skipped_rows("all") == len(rows) - len(answerable)
    assert all(p.prompt == f"{p.question}\nPut the final answer in \\boxed{{}}." for p in problems)  # unicode kept as is
    right = [f"Working it out… so the “answer” is \\boxed{{{rows[p.question]['right']}}}." for p in problems]
    wrong = [f"So the answer is \\boxed{{{rows[p.question]['wrong']}}}." for p in problems]
    golds = [p.answer for p in problems]
    assert scorer.score(right, golds) == [1.0] * len(problems)
    assert scorer.score(wrong, golds) == [0.0] * len(problems)


def test_gsm8k_gold_answers_keep_their_commas_and_signs():
    by_question = {p.question: p.answer for p in load_task(str(DATA / "gsm8k_style.jsonl"), **GSM8K).problems("all")}
    assert sorted(by_question.values()) == sorted(["2,434", "108", "150", "3,234", "-7", "105", "1,000", "24", "750,000"])
    mia = "Mia’s garden has 12 rows of 9 tulips. She calls them her “spring army”. How many tulips are in the army?"
    assert by_question[mia] == "108"  # curly quotes read as they are
    assert score_one([(accuracy_reward, 1.0)], "\\boxed{750000}", "750,000", timeout_s=5) == 1.0
    assert score_one([(accuracy_reward, 1.0)], "\\boxed{75,000}", "750,000", timeout_s=5) == 0.0


def test_stop_strings_cut_a_completion_before_it_is_scored():
    from swarm.tasks import cut_at_stop

    rambling = "\\boxed{108}\nQuestion: and 2+2?\n\\boxed{4}"
    assert cut_at_stop(rambling, ["\nQuestion:", "</s>"]) == "\\boxed{108}"
    assert cut_at_stop(rambling, ["</s>"]) == rambling and cut_at_stop(rambling, []) == rambling
    assert cut_at_stop("a STOP b stop c", ["stop", "STOP"]) == "a "  # the earliest occurrence of any of them
    fns = [(accuracy_reward, 1.0)]
    assert score_one(fns, rambling, "108", timeout_s=5) == 0.0  # the policy's invented follow-up answered last
    assert score_one(fns, cut_at_stop(rambling, ["\nQuestion:"]), "108", timeout_s=5) == 1.0


class ScriptedBackend:
    """A generation backend that answers every prompt with fixed texts (no model)."""

    def __init__(self, texts):
        self.texts = texts

    def generate(self, prompts, params):
        from swarm.generation.base import Generation

        return [Generation([1], [[2]] * len(self.texts), [[0.0]] * len(self.texts), list(self.texts)) for _ in prompts]


def test_evaluation_scores_completions_up_to_the_tasks_stop_strings(scorer):
    from swarm.evaluation import evaluate_policy

    task = load_task(str(DATA / "gsm8k_style.jsonl"), stop_strings=["\nQuestion:"], **GSM8K)
    problems = [p for p in task.problems("all") if p.answer == "108"]
    backend = ScriptedBackend(["\\boxed{108}\nQuestion: and 2+2?\n\\boxed{4}", "\\boxed{107}"])
    found = evaluate_policy(backend, scorer, problems, samples=2, temperature=1.0, max_completion_length=8, seed=0,
                            greedy=False, stop_strings=task.stop_strings)
    assert found["pass_at_1"] == 0.5
    uncut = evaluate_policy(backend, scorer, problems, samples=2, temperature=1.0, max_completion_length=8, seed=0, greedy=False)
    assert uncut["pass_at_1"] == 0.0


def test_system_prompt_and_chat_template_choice(tmp_path):
    from swarm.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    path = DATA / "math_style.jsonl"
    chat = load_task(str(path), tokenizer=tok, system_prompt="Be brief.", prompt_template="Problem: {question}", **MATH)
    first = chat.problems("all")[0]
    assert first.prompt == f"<system>Be brief.<user>Problem: {first.question}<assistant>"
    plain = load_task(str(path), tokenizer=tok, system_prompt="Be brief.", apply_chat_template=False, **MATH)
    assert plain.problems("all")[0].prompt == f"Be brief.\n\n{first.question}\nPut the final answer in \\boxed{{}}."
    # LaTeX braces in a template are written as they are (no str.format doubling)
    boxed = load_task(str(path), prompt_template="{question} Answer in \\boxed{}.", **MATH).problems("all")[0]
    assert boxed.prompt == f"{first.question} Answer in \\boxed{{}}."


# ---------------------------------------------------------------------------------------------
# Splits: a source's own test split when it has one; else every row (eval) or a 10% hold-out (training)


@pytest.mark.parametrize(
    "wanted, available, plan",
    [
        ("test", ["train", "test"], [("test", None)]),  # GSM8K: its own test split
        ("train", ["train", "test"], [("train", None)]),  # ... and all of its train split
        ("test", ["train"], [("train", "test")]),  # a single file: the hold-out
        ("train", ["train"], [("train", "train")]),  # ... and the rest
        ("test", ["train", "validation"], [("train", "test")]),
        ("all", ["train", "test"], [("train", None), ("test", None)]),
        ("all", ["train"], [("train", None)]),
        ("test", ["test"], [("test", None)]),  # an evaluation-only dataset (MATH-500)
    ],
)
def test_plan_split_reads_a_sources_own_splits(wanted, available, plan):
    from swarm.tasks.dataset import plan_split

    assert plan_split(wanted, available) == plan


def test_plan_split_errors_name_the_splits():
    from swarm.tasks.dataset import plan_split

    with pytest.raises(ValueError, match="has no train split; its splits are test"):
        plan_split("train", ["test"])
    with pytest.raises(ValueError, match="neither a train nor a test split; its splits are validation"):
        plan_split("test", ["validation"])
    with pytest.raises(ValueError, match="unknown split 'dev'; use one of: all, train, test"):
        plan_split("dev", ["train"])


def test_a_directory_with_split_files_reads_them_as_a_hub_dataset_would(tmp_path):
    """A local directory goes through the same datasets.load_dataset(source, config, split=...) call
    as a hub id, with the splits named by its files."""
    source = tmp_path / "gsm"
    source.mkdir()
    for split, n in (("train", 30), ("test", 7)):
        (source / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": f"{split} question {i}", "answer": f"...\n#### {i}"}) + "\n" for i in range(n)))
    task = load_task(str(source), **GSM8K)
    assert task.source_splits == ["train", "test"] and task.eval_split == "test"
    assert [p.question for p in task.problems("test")] == [f"test question {i}" for i in range(7)]
    assert [p.question for p in task.problems("train")] == [f"train question {i}" for i in range(30)]  # nothing held out
    assert len(task.problems("all")) == 37
    assert len({p.problem_id for p in task.problems("all")}) == 37  # ids unique across splits
    assert "the test split of gsm" == task.describe_split("test")
    (source / "test.jsonl").unlink()  # a train split only: test is its 10% hold-out again
    alone = load_task(str(source), **GSM8K)
    assert alone.eval_split == "all"
    held, rest = alone.problems("test"), alone.problems("train")
    assert held and not {p.problem_id for p in held} & {p.problem_id for p in rest} and len(held) + len(rest) == 30


def test_a_single_file_is_evaluated_whole_and_trained_on_without_its_hold_out():
    task = load_task(str(DATA / "gsm8k_style.jsonl"), **GSM8K)
    assert task.source_splits == ["train"] and task.eval_split == "all"
    every = {p.problem_id for p in task.problems("all")}
    train, test = ({p.problem_id for p in task.problems(s)} for s in ("train", "test"))
    assert len(every) == 9 and train | test == every and not train & test
    assert task.describe_split("all") == "every row of gsm8k_style"


# ---------------------------------------------------------------------------------------------
# One set of task options for every role, checked where they are given


def test_every_role_takes_the_same_task_options_and_they_reach_the_task():
    from swarm.config import EvalConfig, LearnerConfig, SamplerConfig, TaskSettings, TrainerConfig

    for role in (EvalConfig, LearnerConfig, SamplerConfig, TrainerConfig):
        assert set(TaskSettings.model_fields) <= set(role.model_fields), role.__name__
    settings = TaskSettings(task=str(DATA / "gsm8k_style.jsonl"), answer_pattern=r"####\s*(.+)", stop=["\nQ:"],
                            system_prompt="Be brief.", apply_chat_template=False, prompt_template="Q: {question}")
    task = load_task(settings.task, **settings.task_options())
    assert task.stop_strings == ("\nQ:",) and task.problems("all")[0].prompt.startswith("Be brief.\n\nQ: A shop sells")
    assert load_task("arithmetic", **TaskSettings(stop_strings=["\n"]).task_options()).stop_strings == ("\n",)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(task="x.jsonl", answer_pattern="####(.+"), "'####(.+' is not a regular expression"),
        (dict(task="x.jsonl", prompt_template="Q:"), "'Q:' has no {question}"),
        (dict(answer_pattern="####(.+)"), "--answer-pattern applies to dataset tasks, not the built-in arithmetic task"),
        (dict(dataset_config="main"), "--dataset-config applies to dataset tasks"),
        (dict(task="x.jsonl", difficulty=3), "--difficulty applies to the built-in arithmetic task only"),
        (dict(stop_strings=["</s>", ""]), "an empty stop string"),
    ],
)
def test_bad_task_options_say_what_to_change(options, message):
    from pydantic import ValidationError

    from swarm.config import TaskSettings

    with pytest.raises(ValidationError, match=re.escape(message)):
        TaskSettings(**options)


# ---------------------------------------------------------------------------------------------
# Hub names: a machine that cannot reach the hub says so at once


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """The hub at a local port nothing listens on, and an empty Hugging Face cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_hub_model_fails_at_once_when_the_hub_cannot_be_reached(no_hub):
    from swarm.model.loading import resolve_model_dir

    started = time.time()
    with pytest.raises(ConnectionError, match="model 'someone/some-model' is not a local directory and the Hugging Face "
                                              "hub cannot be reached: .*Pass a local model directory"):
        resolve_model_dir("someone/some-model")
    assert time.time() - started < 5


def test_an_unreachable_hub_falls_back_to_the_cached_copy(no_hub):
    from swarm.model.loading import resolve_model_dir

    snapshot = no_hub / "models--someone--some-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (no_hub / "models--someone--some-model" / "refs").mkdir()
    (no_hub / "models--someone--some-model" / "refs" / "main").write_text("abc123")
    assert Path(resolve_model_dir("someone/some-model")) == snapshot


def test_hub_offline_without_a_cached_copy_says_so(no_hub, monkeypatch):
    from huggingface_hub import constants

    from swarm.model.loading import resolve_model_dir

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match="cannot be reached: HF_HUB_OFFLINE is set; nor is it in the Hugging Face cache"):
        resolve_model_dir("someone/some-model")


def test_a_silent_hub_is_given_up_on_within_the_check_time(monkeypatch):
    """A hub that accepts connections and never answers costs the check's time, not the retries'."""
    import socket

    from huggingface_hub import constants

    from swarm.hub import hub_unreachable

    with socket.create_server(("127.0.0.1", 0)) as silent:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.time()
        assert hub_unreachable(timeout_s=0.5)
        assert time.time() - started < 2


def test_a_hub_dataset_fails_at_once_when_the_hub_cannot_be_reached(no_hub):
    started = time.time()
    with pytest.raises(ConnectionError, match="dataset 'someone/gsm' is not a local file or directory and the Hugging "
                                              "Face hub cannot be reached"):
        load_task("someone/gsm", dataset_config="main").problems("test")
    assert time.time() - started < 5
