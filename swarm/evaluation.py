"""Evaluate a policy on a task: pass@1 averaged over n samples per prompt, pass@k for chosen k, and
greedy accuracy. One routine (`evaluate_policy`) serves `swarm eval`, the demo, the in-process
trainer and the learner's held-out evaluations."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from swarm.config import EvalSettings, GenerationSettings, TaskSettings, default_of
from swarm.generation import SamplingParams, make_backend
from swarm.generation.transformers_backend import TransformersBackend
from swarm.model.device import resolve_dtype
from swarm.model.loading import resolve_model_dir
from swarm.progress import Progress, ProgressTask
from swarm.rewards import RewardScorer
from swarm.tasks import check_task_name, load_task
from swarm.tasks.base import Problem, cut_at_stop


@dataclass
class EvalResult:
    model: str
    task: str
    split: str
    num_problems: int  # problems evaluated
    problems_in_split: int  # problems the split holds (num_problems is fewer with --eval-problems)
    rows_skipped: int  # rows of the split without a question or a gold answer (--answer-pattern did not match)
    samples_per_problem: int
    temperature: float
    pass_at_1: float  # mean over problems of (correct samples / n)
    greedy_accuracy: float | None  # temperature-0 accuracy (None when not measured)
    unscorable: int  # completions whose reward could not be computed
    completion_tokens: int
    seconds: float
    pass_at_k: dict[int, float] = field(default_factory=dict)  # k -> unbiased pass@k over the n samples (pass_at_k)
    shown: list[dict] = field(default_factory=list)  # completions to show: {"problem_id", "prompt", "answer", "completion", "reward"}

    def as_dict(self) -> dict:
        return asdict(self)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k),
    the chance that k of the n drawn without replacement hold a correct one (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per problem (n = {n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def score_problems(backend, scorer, problems: Sequence[Problem], params, *, progress: ProgressTask | None = None,
                   chunk: int = 32, stop_strings: Sequence[str] = (), counts: list[int] | None = None,
                   shown: list[dict] | None = None, show: int = 0):
    """Generate for each problem and score each completion up to its first stop string: returns
    (per-problem correct fractions, unscorable, tokens). `progress` is advanced by problems done;
    `counts`, when given, gets each problem's number of correct completions, and `shown` the first
    `show` completions with their rewards."""
    fractions: list[float] = []
    unscorable = tokens = 0
    for start in range(0, len(problems), chunk):
        part = problems[start : start + chunk]
        gens = backend.generate([p.prompt for p in part], params)
        for problem, gen in zip(part, gens):
            texts = [cut_at_stop(text, stop_strings) for text in gen.texts]
            rewards = scorer.score(texts, [problem.answer] * len(texts))
            unscorable += sum(r is None for r in rewards)
            correct = sum(1 for r in rewards if r is not None and r > 0.5)
            fractions.append(correct / len(rewards))
            if counts is not None:
                counts.append(correct)
            for text, reward in zip(texts, rewards):
                if shown is not None and len(shown) < show:
                    shown.append({"problem_id": problem.problem_id, "prompt": problem.prompt, "answer": problem.answer,
                                  "completion": text, "reward": reward})
            tokens += gen.num_tokens()
        if progress is not None:
            progress.advance(len(part))
    return fractions, unscorable, tokens


def evaluate_policy(backend, scorer, problems: Sequence[Problem], *, samples: int, temperature: float,
                    max_completion_length: int, seed: int, greedy: bool = True, progress: Progress | None = None,
                    stop_strings: Sequence[str] = (), label: str = "eval", ks: Sequence[int] = (), show: int = 0) -> dict:
    """The one evaluation routine: pass@1 over `samples` completions per problem (seeded), pass@k for
    each k of `ks` and, with `greedy`, temperature-0 accuracy, each completion scored up to its first
    stop string. Returns {"pass_at_1", "pass_at_k", "greedy_accuracy", "unscorable",
    "completion_tokens", "shown"} (`shown`: the first `show` sampled completions with their rewards);
    `progress` (swarm.progress) hears of the problems done, each pass a task named after `label`."""
    for k in ks:
        if not 1 <= k <= samples:
            raise ValueError(f"pass@{k} needs at least {k} samples per problem; raise --eval-samples to {k} or more")
    def task(what: str):
        return progress.task(f"{label}, {what}", total=len(problems), unit="problems") if progress is not None else nullcontext()

    sampled = SamplingParams(num_completions=samples, temperature=temperature, max_new_tokens=max_completion_length, seed=seed)
    with task(f"{samples} sample{'s' if samples != 1 else ''} per problem") as job:
        counts: list[int] = []
        shown: list[dict] = []
        fractions, unscorable, tokens = score_problems(backend, scorer, problems, sampled, progress=job,
                                                       stop_strings=stop_strings, counts=counts, shown=shown, show=show)
    greedy_accuracy = None
    if greedy:
        params = SamplingParams(num_completions=1, temperature=0, max_new_tokens=max_completion_length)
        with task("greedy") as job:
            g_fractions, g_unscorable, g_tokens = score_problems(backend, scorer, problems, params, progress=job,
                                                                 stop_strings=stop_strings)
        greedy_accuracy = sum(g_fractions) / len(g_fractions)
        unscorable += g_unscorable
        tokens += g_tokens
    at_k = {k: sum(pass_at_k(samples, c, k) for c in counts) / len(counts) for k in ks}
    return {"pass_at_1": sum(fractions) / len(fractions), "pass_at_k": at_k, "greedy_accuracy": greedy_accuracy,
            "unscorable": unscorable, "completion_tokens": tokens, "shown": shown}


@dataclass
class Selection:
    """The problems an evaluation reads, and how they were chosen (said before it starts)."""

    split: str
    problems: list[Problem]
    available: int  # problems the split holds
    skipped: int  # rows of the split without a question or a gold answer
    description: str  # what the split is, in words

    def summary(self) -> str:
        """"20 of 20 problems (every row of gsm)", with the rows left out for want of an answer."""
        line = f"{len(self.problems)} of {self.available} problems ({self.description})"
        if self.skipped:
            line += f"; {self.skipped} rows without a question or a gold answer (see --answer-pattern) left out"
        return line


def select_problems(task, split: str | None, limit: int | None) -> Selection:
    """The problems of `split` (unset: the task's own evaluation split: a dataset's test split, a
    single file's every row), at most `limit` of them."""
    split = split or task.eval_split
    problems = list(task.problems(split))
    if not problems:
        raise ValueError(f"task {task.name!r} has no problems in split {split!r}")
    return Selection(split, problems[: limit or None], len(problems), task.skipped_rows(split), task.describe_split(split))


def evaluate(
    model: str | None,
    task_name: str = default_of(TaskSettings, "task"),
    *,
    split: str | None = "test",
    limit: int | None = default_of(EvalSettings, "eval_problems"),
    samples: int = default_of(EvalSettings, "eval_samples"),
    temperature: float = default_of(GenerationSettings, "temperature"),
    max_completion_length: int = default_of(GenerationSettings, "max_completion_length"),
    greedy: bool = True,
    backend_name: str = "transformers",
    device: str = "cpu",
    dtype: str = "auto",
    seed: int = 0,
    progress: Progress | None = None,
    task_options: dict | None = None,
    echo: Callable[[str], None] | None = None,
    ks: Sequence[int] = (),
    show: int = 0,
) -> EvalResult:
    """Load `model` and `task_name` and evaluate (`swarm eval`, the demo's before/after). `split`
    None is the task's own evaluation split; `echo` hears which problems, before they are evaluated;
    `progress` (swarm.progress) how far the evaluation is (and the embedded policy's first build)."""
    check_task_name(task_name)  # an unknown task or a missing file is said before the model loads
    model_dir = resolve_model_dir(model, progress=progress is not None and progress.terminal)
    dtype = resolve_dtype(dtype, device)
    options = {"device": device, "dtype": dtype} if backend_name == "transformers" else {"dtype": dtype}
    backend = make_backend(backend_name, model_dir, **options)
    task = load_task(task_name, tokenizer=getattr(backend, "tokenizer", None), **(task_options or {}))
    chosen = select_problems(task, split, limit)
    if echo is not None:
        echo(f"evaluating {chosen.summary()}")
    scorer = RewardScorer([("accuracy", 1.0)])
    started = time.time()
    try:
        found = evaluate_policy(backend, scorer, chosen.problems, samples=samples, temperature=temperature,
                                max_completion_length=max_completion_length, seed=seed, greedy=greedy, progress=progress,
                                stop_strings=task.stop_strings, ks=ks, show=show)
    finally:
        scorer.close()
    return EvalResult(model=model or "embedded", task=task_name, split=chosen.split, num_problems=len(chosen.problems),
                      problems_in_split=chosen.available, rows_skipped=chosen.skipped, samples_per_problem=samples,
                      temperature=temperature, seconds=round(time.time() - started, 2), **found)


class HeldOutEvaluation:
    """The learner's held-out evaluation (`--eval-every`): pass@1 of its own policy, in place, on the
    task's test problems, sampled as the run samples. `run()` returns the step record's fields
    {"eval_pass_at_1", "eval_seconds"}; the model is left in train mode."""

    def __init__(self, model, tokenizer, problems: Sequence[Problem], *, samples: int, temperature: float,
                 max_completion_length: int, seed: int, stop_strings: Sequence[str] = ()) -> None:
        if not problems:
            raise ValueError("--eval-every: the task has no held-out (test) problems to evaluate on")
        self.model, self.problems = model, list(problems)
        self.backend = TransformersBackend(model, tokenizer, static_cache=False)  # the training model: nothing compiled
        self.scorer = RewardScorer([("accuracy", 1.0)])  # correctness alone, whatever the training rewards
        self.samples, self.temperature, self.max_completion_length = samples, temperature, max_completion_length
        self.seed, self.stop_strings = seed, tuple(stop_strings)

    def run(self) -> dict:
        started = time.time()
        self.model.eval()
        try:
            # the same seed at every evaluation: versions are compared on the same draws
            found = evaluate_policy(self.backend, self.scorer, self.problems, samples=self.samples,
                                    temperature=self.temperature, max_completion_length=self.max_completion_length,
                                    seed=self.seed, greedy=False, stop_strings=self.stop_strings)
        finally:
            self.model.train()
        return {"eval_pass_at_1": found["pass_at_1"], "eval_seconds": round(time.time() - started, 3)}

    def close(self) -> None:
        self.scorer.close()
