"""benchmarks/rankme_correlation.py's arithmetic on planted numbers: the rho, the loss of RankMe's pick, the spread over
seeds and the table (the study itself is not run: it takes an hour and a half)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def study():
    """benchmarks/rankme_correlation.py as a module (it imports machine.py beside it)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("rankme_correlation", BENCHMARKS / "rankme_correlation.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def points(seed, rankme, knn, projector=None, sets=("recipes",)):
    """One seed's checkpoints with planted scores (linear top-1 = kNN top-1 + 1)."""
    projector = projector or [None] * len(rankme)
    return [
        {"seed": seed, "recipe": f"r{i}", "step": 10, "sets": list(sets), "rankme": r, "rankme_projector": p}
        | {"knn": k, "linear": k + 1}
        for i, (r, p, k) in enumerate(zip(rankme, projector, knn))
    ]


def test_rho_and_the_loss_of_rankmes_pick_on_a_planted_permutation(study):
    # guards: a rho or a pick taken on the wrong column, or by rank instead of by value
    found = study.correlate(points(0, [1, 2, 3, 4, 5], [10, 30, 20, 50, 40]), "rankme", "knn")
    # d = (0, 1, 1, 1, 1): rho = 1 - 6 * 4 / (5 * 24); RankMe's pick (5.0) has kNN 40, the best 50
    assert found["rho"] == pytest.approx(0.8)
    assert found["lost"] == pytest.approx(10)
    assert study.correlate(points(0, [5, 4, 3], [70, 80, 90]), "rankme", "linear") == pytest.approx(
        {"rho": -1.0, "lost": 20}
    )


def test_a_score_missing_on_one_checkpoint_gives_no_rho_rather_than_one_over_the_rest(study):
    # guards: a kept step without a projector silently dropped from the projector's rho
    found = study.correlate(points(0, [1, 2, 3], [10, 20, 30], projector=[4, None, 6]), "rankme_projector", "knn")
    assert math.isnan(found["rho"]) and math.isnan(found["lost"])


def test_spread_over_seeds_is_the_sample_std_of_each_seeds_rho_and_the_table_shows_each_seed(study):
    # guards: seeds pooled into one rho, or a population std where the team's tables give n - 1
    by_seed = {0: points(0, [1, 2, 3], [10, 20, 30]), 1: points(1, [3, 2, 1], [10, 20, 30])}
    found = study.summarise(by_seed, "rankme", "knn")
    assert [v["rho"] for v in found["per_seed"].values()] == pytest.approx([1.0, -1.0])
    assert found["rho"] == pytest.approx((0.0, math.sqrt(2)))
    assert found["lost"] == pytest.approx((10.0, math.sqrt(200)))
    assert study.cell(found, "rho", 2) == "0.00 ± 1.41 (1.00, -1.00)"

    table, summaries = study.tables([*by_seed[0], *by_seed[1]])
    rows = {(s["checkpoints"], s["score"]): s for s in summaries}
    assert rows["recipes", "rankme"]["linear"]["rho"] == pytest.approx((0.0, math.sqrt(2)))
    assert "| the 7 recipes' final weights | backbone | 0.00 ± 1.41 (1.00, -1.00) |" in table
    assert "| the 7 recipes' final weights | projector | — | — | — | — |" in table
    assert "| r0, step 10 | 2.0 ± 1.4 | — | 10.0 ± 0.0 | 11.0 ± 0.0 |" in table
