"""pass@k's unbiased estimator (Chen et al. 2021), on hand-computed cases."""

import math

import pytest

from swarm.evaluation import pass_at_k


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
    (4, 0, 2, 0.0),
    (4, 3, 2, 1.0),  # fewer than k wrong samples: every draw of k holds a right one
    (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
    (8, 8, 8, 1.0),
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_1_is_the_fraction_correct_and_pass_at_k_grows_with_k():
    for c in range(9):
        assert pass_at_k(8, c, 1) == pytest.approx(c / 8)
        assert all(pass_at_k(8, c, k) <= pass_at_k(8, c, k + 1) for k in range(1, 8))


def test_k_beyond_the_samples_is_refused():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
