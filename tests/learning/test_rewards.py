"""Rewards: math-verify equivalences, unscorable outputs, registry and dotted paths, threads."""

import threading
import time

import pytest

from swarm.rewards import RewardScorer, accuracy_reward, format_reward, resolve_reward


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac12}", "1/2"),
        ("so the result is \\boxed{68}", "68"),
        ("\\boxed{-17}", "-17"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{50\\%}", "0.5"),
    ],
)
def test_equivalent_forms_are_correct(completion, answer):
    assert accuracy_reward(completion, answer) == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [("\\boxed{69}", "68"), ("\\boxed{0.49}", "\\frac{1}{2}"), ("68", "68"), ("", "3"), ("\\boxed{", "3")],
)
def test_wrong_or_unanchored_answers_score_zero(completion, answer):
    # "68" without \boxed is not an answer: the task asks for \boxed{}
    assert accuracy_reward(completion, answer) == 0.0


def test_unparseable_gold_is_missing_not_zero():
    assert accuracy_reward("\\boxed{3}", "") is None


def test_format_reward():
    assert format_reward("\\boxed{12}", "12") == 1.0
    assert format_reward("  \\boxed{\\frac{1}{2}}\n", "x") == 1.0
    assert format_reward("\\boxed{1}\\boxed{2}", "x") == 0.0
    assert format_reward("\\boxed{12} and more", "12") == 0.0


def slow_reward(completion, answer):
    time.sleep(5)
    return 1.0


def broken_reward(completion, answer):
    raise RuntimeError("boom")


def test_weighted_sum_of_rewards():
    scorer = RewardScorer([("accuracy", 1.0), ("format", 0.25)])
    assert scorer.score(["\\boxed{4}", "\\boxed{5}", "4"], ["4", "4", "4"]) == [1.25, 0.25, 0.0]


def test_slow_and_broken_rewards_give_missing_not_crash():
    scorer = RewardScorer([(f"{__name__}:slow_reward", 1.0)], timeout_s=0.3)
    started = time.time()
    assert scorer.score(["a", "b"], ["1", "1"]) == [None, None]
    assert time.time() - started < 3
    assert RewardScorer([(f"{__name__}.broken_reward", 1.0)]).score(["a"], ["1"]) == [None]


def test_scoring_off_the_main_thread_is_bounded_and_correct():
    scorer = RewardScorer([("accuracy", 1.0)])
    slow = RewardScorer([(f"{__name__}:slow_reward", 1.0)], timeout_s=0.5)
    results = {}

    def work():
        results["ok"] = scorer.score(["\\boxed{\\frac{2}{4}}", "\\boxed{3}"], ["0.5", "0.5"])
        results["slow"] = slow.score(["a"], ["1"])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=120)
    scorer.close()
    slow.close()
    assert not thread.is_alive()
    assert results == {"ok": [1.0, 0.0], "slow": [None]}


def test_unknown_and_bad_reward_names_are_named():
    with pytest.raises(ValueError, match="unknown reward 'acc'.*accuracy"):
        resolve_reward("acc")
    with pytest.raises(ValueError, match="cannot import reward 'nope.module:fn'"):
        RewardScorer([("nope.module:fn", 1.0)])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        RewardScorer().score(["a", "b"], ["1"])


def stalling_reward(completion: str, answer: str) -> float:
    """Stands for math-verify stuck in one C-level operation: ignores SIGALRM, as such a call does."""
    import signal
    import time as clock

    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    if "9^{9^{9}}" in completion:
        clock.sleep(3600)
    return 1.0


def test_a_completion_that_stalls_the_scorer_is_killed_and_the_rest_are_scored():
    from swarm.rewards import KILL_GRACE_S

    scorer = RewardScorer([(f"{__name__}:stalling_reward", 1.0)], timeout_s=0.5)
    try:
        scorer.score(["warm"], ["1"])  # the worker's start is not part of the deadline
        started = time.time()
        out = scorer.score(["\\boxed{1}", "\\boxed{9^{9^{9}}}", "\\boxed{2}"], ["1", "1", "1"])
        elapsed = time.time() - started
        assert out == [1.0, None, 1.0] and scorer.killed == 1
        assert elapsed < 0.5 + KILL_GRACE_S + 30  # bounded by the deadline and a worker's restart, not by the stall
        assert scorer.score(["\\boxed{3}"], ["1"]) == [1.0]  # the fresh worker goes on
    finally:
        scorer.close()


def test_real_math_verify_on_a_tower_of_powers_is_bounded():
    """The 17 characters that stalled the learner for hours (issue 18)."""
    scorer = RewardScorer(timeout_s=1.0)
    try:
        started = time.time()
        out = scorer.score(["\\boxed{9^{9^{9}}}", "\\boxed{42}"], ["3", "42"])
        assert out[1] == 1.0 and out[0] in (None, 0.0)
        assert time.time() - started < 60
    finally:
        scorer.close()


def test_a_short_timeout_does_not_break_the_first_completion_of_a_fresh_worker():
    """math-verify imports sympy on its first call; an alarm inside that import left it half-imported
    and every later completion scored None (seen as whole staleness-study runs at 0% on a loaded
    machine). The worker now makes that first call before it says it is ready."""
    scorer = RewardScorer([("accuracy", 1.0)], timeout_s=0.3)
    try:
        assert scorer.score(["\\boxed{4}", "\\boxed{5}", "\\boxed{4}"], ["4", "4", "4"]) == [1.0, 0.0, 1.0]
    finally:
        scorer.close()
