"""Tests for kiln.warmstart.select: compatibility, outliers, buckets, cold starts, the 10% rule,
pinned parents."""

from __future__ import annotations

import pytest

from kiln import api
from kiln.warmstart import select


def _cand(model_id: str, similarity: float, metric: float = 0.9,
          **fields: object) -> select.Candidate:
    base: dict[str, object] = {
        "model_id": model_id, "similarity": similarity, "metric_name": "validation_accuracy",
        "metric_value": metric, "higher_is_better": True, "modality": "image",
        "task": "classification", "dataset": "digits",
    }
    base.update(fields)
    return select.Candidate(**base)  # type: ignore[arg-type]


def _choose(*candidates: select.Candidate, min_similarity: float = 0.3) -> api.WarmStartDecision:
    return select.choose_parent(candidates, modality="image", task="classification",
                                min_similarity=min_similarity)


# ---------------------------------------------------------------------------------------------
# Buckets
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("similarity", "bucket"), [
    pytest.param(0.0, 0, id="zero"), pytest.param(0.3, 3, id="edge-0.3"),
    pytest.param(0.29, 2, id="below-edge"), pytest.param(0.95, 9, id="top"),
    pytest.param(1.0, 9, id="one-joins-top-bucket"),
])
def test_similarity_falls_in_ten_equal_width_buckets(similarity: float, bucket: int) -> None:
    assert select.bucket_of(similarity) == bucket


def test_highest_bucket_wins_over_better_metric_in_a_lower_bucket() -> None:
    decision = _choose(_cand("a", 0.95, 0.50), _cand("b", 0.85, 0.99))
    assert decision.parent == "a"
    assert decision.outcome is api.WarmStartOutcome.WARM
    assert decision.condition_reason is api.Reason.PARENT_SELECTED


def test_best_metric_wins_within_the_highest_bucket() -> None:
    decision = _choose(_cand("a", 0.99, 0.80), _cand("b", 0.91, 0.95), _cand("c", 0.5, 1.0))
    assert decision.parent == "b"
    assert decision.similarity == 0.91 and decision.parent_metric == 0.95
    assert decision.candidates_considered == 3
    assert "similarity 0.91" in decision.reason and "bucket 0.9-1.0" in decision.reason


def test_lower_loss_is_better_for_loss_metrics() -> None:
    loss = {"metric_name": "validation_loss", "higher_is_better": False}
    decision = _choose(_cand("a", 0.92, 0.7, **loss), _cand("b", 0.95, 0.4, **loss))
    assert decision.parent == "b"


def test_ties_go_to_the_higher_similarity_then_the_smaller_id() -> None:
    assert _choose(_cand("a", 0.91), _cand("b", 0.97)).parent == "b"
    assert _choose(_cand("z", 0.95), _cand("m", 0.95)).parent == "m"


def test_a_bucket_mixing_metrics_compares_only_its_most_common_metric() -> None:
    loss = {"metric_name": "validation_loss", "higher_is_better": False}
    decision = _choose(_cand("acc1", 0.95, 0.8), _cand("acc2", 0.96, 0.9),
                       _cand("loss", 0.99, 0.01, **loss))
    assert decision.parent == "acc2"
    assert "compared on validation_accuracy only" in decision.reason


# ---------------------------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------------------------

def test_incompatible_candidates_are_dropped_and_counted() -> None:
    decision = _choose(_cand("text", 0.99, modality="text"),
                       _cand("lm", 0.98, task="language_modeling"), _cand("img", 0.6))
    assert decision.parent == "img"
    assert decision.dropped_incompatible == 2
    assert "2 incompatible dropped" in decision.reason


def test_metric_outlier_is_dropped_even_in_the_top_bucket() -> None:
    # Population z-scores can only exceed 3 in groups of 11 or more.
    others = [_cand(f"m{k}", 0.5, 0.90 + 0.001 * k) for k in range(10)]
    decision = _choose(_cand("broken", 0.99, 0.10), *others)
    assert decision.parent != "broken"
    assert decision.dropped_outliers == 1 and decision.candidates_considered == 10
    assert "1 metric outlier dropped" in decision.reason


def test_loss_outliers_are_the_high_ones() -> None:
    loss = {"metric_name": "validation_loss", "higher_is_better": False}
    group = [_cand(f"m{k}", 0.5, 0.30 + 0.001 * k, **loss) for k in range(10)]
    kept = select.drop_outliers([_cand("diverged", 0.99, 9.0, **loss), *group])
    assert [c.model_id for c in kept] == [c.model_id for c in group]


def test_outliers_are_judged_per_task_dataset_and_metric_group() -> None:
    digits = [_cand(f"d{k}", 0.5, 0.99) for k in range(10)]
    cifar = _cand("cifar", 0.9, 0.40, dataset="cifar10")  # alone in its group: kept
    assert cifar in select.drop_outliers([cifar, *digits])


def test_groups_under_three_members_are_not_filtered() -> None:
    pair = [_cand("a", 0.5, 0.99), _cand("b", 0.5, 0.01)]
    assert select.drop_outliers(pair) == pair


def test_non_finite_metrics_are_dropped() -> None:
    decision = _choose(_cand("nan", 0.99, float("nan")), _cand("ok", 0.5))
    assert decision.parent == "ok" and decision.dropped_outliers == 1


# ---------------------------------------------------------------------------------------------
# Cold starts
# ---------------------------------------------------------------------------------------------

def test_cold_start_when_best_match_below_min_similarity() -> None:
    decision = _choose(_cand("small_resnet-7f3c", 0.21), _cand("vgg11_bn-1234", 0.05))
    assert decision.parent is None and decision.cold_start
    assert decision.outcome is api.WarmStartOutcome.COLD_BELOW_MIN_SIMILARITY
    assert decision.condition_reason is api.Reason.COLD_START
    assert decision.reason.startswith(
        "cold start: best zoo match small_resnet-7f3c has similarity 0.21 < minSimilarity 0.30")
    assert decision.similarity == 0.21


def test_cold_start_on_an_empty_zoo() -> None:
    decision = _choose()
    assert decision.outcome is api.WarmStartOutcome.COLD_EMPTY
    assert decision.reason == "cold start: the model zoo is empty"


def test_cold_start_when_every_zoo_model_is_incompatible() -> None:
    decision = _choose(_cand("t1", 0.9, modality="text"), _cand("t2", 0.8, modality="text"))
    assert decision.outcome is api.WarmStartOutcome.COLD_INCOMPATIBLE
    assert decision.reason == ("cold start: none of the 2 zoo models is an image classification "
                               "model")
    assert decision.dropped_incompatible == 2


def test_candidates_below_min_similarity_never_win_their_bucket() -> None:
    decision = _choose(_cand("above", 0.36, 0.5), _cand("below", 0.31, 0.99),
                       min_similarity=0.35)
    assert decision.parent == "above"


def test_invalid_similarities_are_rejected() -> None:
    with pytest.raises(ValueError, match="similarity"):
        _cand("x", 1.2)
    with pytest.raises(ValueError, match="min_similarity"):
        _choose(_cand("x", 0.5), min_similarity=-0.1)


# ---------------------------------------------------------------------------------------------
# The 10% rule and pinned parents
# ---------------------------------------------------------------------------------------------

def test_finalize_cold_starts_when_under_ten_percent_of_tensors_transfer() -> None:
    decision = select.finalize(_choose(_cand("small_resnet-7f3c", 0.8)), 3, 40)
    assert decision.parent is None
    assert decision.outcome is api.WarmStartOutcome.COLD_FEW_TENSORS
    assert decision.reason == ("cold start: only 3 of 40 weight tensors (7.5%) of the child "
                               "transfer from small_resnet-7f3c (similarity 0.80), below the 10% "
                               "minimum")
    assert (decision.matched_tensors, decision.total_tensors) == (3, 40)


def test_finalize_keeps_a_parent_at_ten_percent_or_more_and_adds_the_counts() -> None:
    decision = select.finalize(_choose(_cand("p", 0.8)), 4, 40)
    assert decision.parent == "p"
    assert decision.reason.endswith("; 4 of 40 weight tensors (10.0%) transfer")


def test_finalize_leaves_a_cold_start_cold() -> None:
    cold = _choose()
    assert select.finalize(cold, 0, 10) == cold.model_copy(update={"matched_tensors": 0,
                                                                   "total_tensors": 10})
    with pytest.raises(ValueError):
        select.finalize(cold, 11, 10)


def test_pinned_parent_reports_similarity_and_threshold() -> None:
    decision = select.pinned(_cand("pin-1", 0.12), modality="image", task="classification",
                             min_similarity=0.3)
    assert decision.parent == "pin-1" and decision.outcome is api.WarmStartOutcome.PINNED
    assert decision.reason == ("candidate parent pin-1 (pinned): similarity 0.12 (below "
                               "minSimilarity 0.30, used because it is pinned)")
    assert select.finalize(decision, 1, 50).cold_start  # the 10% rule still applies


def test_pinned_parent_of_another_modality_is_flagged() -> None:
    decision = select.pinned(_cand("pin-2", 0.5, modality="text", task="language_modeling"),
                             modality="image", task="classification", min_similarity=0.3)
    assert "it is a text language_modeling model, the job an image classification one" in (
        decision.reason)


# ---------------------------------------------------------------------------------------------
# spec.warmStart.preferred
# ---------------------------------------------------------------------------------------------

def _prefer(*candidates: select.Candidate, preferred: list[str]) -> api.WarmStartDecision:
    return select.choose_parent(candidates, modality="image", task="classification",
                                min_similarity=0.3, preferred=preferred)


def test_a_preferred_model_within_005_of_the_best_match_wins() -> None:
    cands = (_cand("stranger", 0.95, 0.99), _cand("trial-3", 0.91, 0.70),
             _cand("trial-1", 0.90, 0.80), _cand("far", 0.50, 1.0))
    assert _choose(*cands).parent == "stranger"  # the policy alone
    decision = _prefer(*cands, preferred=["gone", "trial-3", "trial-1"])
    assert decision.parent == "trial-3"  # the first preferred id present, not the better one
    assert decision.similarity == 0.91 and decision.parent_metric == 0.70
    assert decision.outcome is api.WarmStartOutcome.WARM
    assert ("listed in spec.warmStart.preferred and within 0.05 of the best match stranger "
            "(0.95), so chosen over stranger") in decision.reason
    assert _prefer(*cands, preferred=["trial-1", "trial-3"]).parent == "trial-1"


def test_a_preferred_model_further_than_005_from_the_best_match_does_not_win() -> None:
    cands = (_cand("stranger", 0.96, 0.99), _cand("trial-0", 0.90, 0.99))
    assert _prefer(*cands, preferred=["trial-0"]).parent == "stranger"
    assert _prefer(*cands, preferred=["far", "unknown"]).parent == "stranger"


def test_preference_never_lifts_a_model_the_policy_drops() -> None:
    # Below minSimilarity, or of another task: preferred or not, it is no candidate.
    low = (_cand("only", 0.32), _cand("trial-0", 0.29))
    assert _prefer(*low, preferred=["trial-0"]).parent == "only"
    text = _cand("trial-0", 0.95, task="language_modeling")
    assert _prefer(_cand("img", 0.94), text, preferred=["trial-0"]).parent == "img"
