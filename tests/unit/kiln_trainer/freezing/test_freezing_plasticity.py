"""kiln_trainer.freezing.plasticity: SP loss identities and bounds, EMA, convergence detector."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kiln_trainer.freezing import plasticity


def _pair(b: int = 8, *shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = shape or (3, 4, 4)
    return torch.randn(b, *shape, generator=generator), torch.randn(b, *shape, generator=generator)


# -- sp_loss ---------------------------------------------------------------------------------


def test_sp_loss_of_an_activation_with_itself_is_zero() -> None:
    a, _ = _pair()
    assert plasticity.sp_loss(a, a) == pytest.approx(0.0, abs=1e-15)
    assert plasticity.sp_loss(a, a.clone().float().half().float()) < 1e-5


def test_sp_loss_is_symmetric_and_positive_for_different_activations() -> None:
    a, r = _pair()
    assert plasticity.sp_loss(a, r) == pytest.approx(plasticity.sp_loss(r, a), rel=1e-12)
    assert plasticity.sp_loss(a, r) > 0.0


@pytest.mark.parametrize("scale", [1e-3, 0.5, 7.0, 1e4])
def test_sp_loss_is_invariant_to_a_positive_global_scale(scale: float) -> None:
    a, r = _pair()
    assert plasticity.sp_loss(scale * a, r) == pytest.approx(plasticity.sp_loss(a, r), rel=1e-6)


def test_sp_loss_is_invariant_to_a_channel_permutation() -> None:
    a, r = _pair(8, 6, 4, 4)
    permuted = a[:, torch.randperm(6, generator=torch.Generator().manual_seed(1))]
    assert plasticity.sp_loss(permuted, r) == pytest.approx(plasticity.sp_loss(a, r), rel=1e-9)


def test_sp_loss_is_invariant_to_an_orthogonal_feature_transform() -> None:
    a, r = _pair(8, 12)
    q, _ = torch.linalg.qr(torch.randn(12, 12, generator=torch.Generator().manual_seed(2)))
    assert plasticity.sp_loss(a @ q, r) == pytest.approx(plasticity.sp_loss(a, r), rel=1e-6)


def test_sp_loss_compares_activations_of_different_widths() -> None:
    a, _ = _pair(8, 3, 4, 4)
    _, r = _pair(8, 17, seed=5)
    assert 0.0 < plasticity.sp_loss(a, r) <= 4.0 / 8


@pytest.mark.parametrize("b", [2, 3, 8, 32])
def test_sp_loss_stays_within_4_over_b_and_2_over_b_for_non_negative_activations(b: int) -> None:
    for seed in range(20):
        a, r = _pair(b, 5, seed=seed)
        r = -r * torch.linspace(0.1, 3.0, 5)  # different directions and scales on purpose
        assert 0.0 <= plasticity.sp_loss(a, r) <= 4.0 / b
        assert plasticity.sp_loss(a.relu(), r.relu()) <= 2.0 / b


def test_sp_loss_computes_in_float64_whatever_the_input_dtype() -> None:
    a, r = _pair()
    assert plasticity.sp_loss(a.half(), r.half()) == pytest.approx(
        plasticity.sp_loss(a, r), rel=1e-2
    )
    assert isinstance(plasticity.sp_loss(a.double(), r), float)


def test_sp_loss_keeps_an_all_zero_sample_finite() -> None:
    a, r = _pair()
    a[0] = 0.0
    assert math.isfinite(plasticity.sp_loss(a, r))


@pytest.mark.parametrize(
    ("a", "r"),
    [
        pytest.param(torch.randn(4, 3), torch.randn(5, 3), id="different-batch"),
        pytest.param(torch.randn(1, 3), torch.randn(1, 3), id="batch-of-one"),
        pytest.param(torch.tensor(1.0), torch.tensor(1.0), id="scalar"),
    ],
)
def test_sp_loss_rejects_mismatched_or_too_small_batches(a: torch.Tensor, r: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="sp_loss"):
        plasticity.sp_loss(a, r)


# -- Ema -------------------------------------------------------------------------------------


def test_ema_starts_at_the_first_value_then_weighs_the_history_by_alpha() -> None:
    ema = plasticity.Ema(0.8)
    assert ema.value is None
    assert ema.update(1.0) == 1.0
    assert ema.update(2.0) == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)
    assert ema.value == pytest.approx(1.2)
    ema.reset()
    assert ema.value is None
    assert ema.update(5.0) == 5.0


@pytest.mark.parametrize("alpha", [-0.1, 1.0, 1.5])
def test_ema_rejects_alpha_outside_zero_to_one(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        plasticity.Ema(alpha)


def test_ema_rejects_a_non_finite_value() -> None:
    with pytest.raises(ValueError, match="finite"):
        plasticity.Ema(0.5).update(math.nan)


# -- ConvergenceDetector -------------------------------------------------------------------


def _feed(detector: plasticity.ConvergenceDetector, values: list[float]) -> list[bool]:
    return [detector.add(v) for v in values]


def test_normalised_change_is_the_fitted_change_over_the_window_relative_to_its_mean() -> None:
    assert plasticity.normalised_change([1.0, 1.0, 1.0]) == 0.0
    # values 1, 2, 3: slope 1 per probe, W = 3, mean 2 -> 1 * 3 / 2
    assert plasticity.normalised_change([1.0, 2.0, 3.0]) == pytest.approx(1.5)
    assert plasticity.normalised_change([3.0, 2.0, 1.0]) == pytest.approx(1.5)
    assert plasticity.normalised_change([0.0, 0.0]) == 0.0
    assert plasticity.normalised_change([-1.0, 1.0]) == math.inf


def test_flat_sequence_converges_after_patience_windows() -> None:
    detector = plasticity.ConvergenceDetector(window=4, tolerance=0.05, patience=2)
    flags = _feed(detector, [0.010 + 0.0001 * (i % 2) for i in range(12)])
    assert flags[:7] == [False] * 7  # two windows of 4 values are needed
    assert flags[7:] == [True] * 5
    assert detector.converged and detector.last_change is not None
    assert detector.last_change < 0.05


def test_patience_one_converges_after_one_flat_window() -> None:
    detector = plasticity.ConvergenceDetector(window=3, tolerance=0.1, patience=1)
    assert _feed(detector, [1.0, 1.0, 1.0]) == [False, False, True]


@pytest.mark.parametrize("noise", [0.0, 0.02], ids=["rising", "noisy-rising"])
def test_rising_sequence_never_converges(noise: float) -> None:
    generator = torch.Generator().manual_seed(3)
    detector = plasticity.ConvergenceDetector(window=5, tolerance=0.1, patience=2)
    jitter = (torch.rand(60, generator=generator) - 0.5) * 2 * noise
    # 5% per probe: |slope| * W / mean stays near 0.05 * 5 = 0.25 > tolerance at any level
    values = [0.01 * 1.05**i * (1 + float(j)) for i, j in enumerate(jitter)]
    assert not any(_feed(detector, values))


def test_one_rising_window_breaks_the_run_of_flat_windows() -> None:
    detector = plasticity.ConvergenceDetector(window=3, tolerance=0.05, patience=2)
    flags = _feed(detector, [1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    assert flags == [False] * 11 + [True]


def test_reset_clears_the_partial_window_and_the_run_of_flat_windows() -> None:
    detector = plasticity.ConvergenceDetector(window=2, tolerance=0.1, patience=2)
    _feed(detector, [1.0, 1.0, 1.0, 1.0])
    assert detector.converged
    detector.reset()
    assert not detector.converged and detector.last_change is None
    assert _feed(detector, [1.0, 1.0, 1.0, 1.0]) == [False, False, False, True]


def test_drop_partial_window_keeps_the_run_of_flat_windows() -> None:
    detector = plasticity.ConvergenceDetector(window=3, tolerance=0.1, patience=2)
    _feed(detector, [1.0, 1.0, 1.0, 50.0])
    detector.drop_partial_window()  # the 50.0 was measured against an older reference
    assert _feed(detector, [1.0, 1.0, 1.0]) == [False, False, True]


def test_a_non_finite_value_restarts_the_detector() -> None:
    detector = plasticity.ConvergenceDetector(window=2, tolerance=0.1, patience=1)
    assert _feed(detector, [1.0, 1.0]) == [False, True]
    assert detector.add(math.nan) is False
    assert not detector.converged


def test_state_round_trips_through_json() -> None:
    detector = plasticity.ConvergenceDetector(window=3, tolerance=0.1, patience=2)
    _feed(detector, [1.0, 1.0, 1.0, 1.0])
    state = json.loads(json.dumps(detector.state_dict(), allow_nan=False))
    restored = plasticity.ConvergenceDetector(window=3, tolerance=0.1, patience=2)
    restored.load_state_dict(state)
    assert restored.state_dict() == detector.state_dict()
    # the same next values give the same answers
    assert _feed(restored, [1.0, 1.0, 1.0]) == _feed(detector, [1.0, 1.0, 1.0]) == [
        False, True, True,
    ]


def test_state_with_an_infinite_last_change_stays_json() -> None:
    detector = plasticity.ConvergenceDetector(window=2, tolerance=0.1)
    _feed(detector, [-1.0, 1.0])
    assert detector.last_change == math.inf
    json.dumps(detector.state_dict(), allow_nan=False)


def test_loading_a_state_with_another_window_keeps_the_job_settings() -> None:
    saved = plasticity.ConvergenceDetector(window=4, tolerance=0.1, patience=2)
    _feed(saved, [1.0] * 6)
    restored = plasticity.ConvergenceDetector(window=3, tolerance=0.2, patience=2)
    restored.load_state_dict(saved.state_dict())
    state = restored.state_dict()
    assert (state["window"], state["tolerance"], state["values"]) == (3, 0.2, [])


def test_loading_a_malformed_state_raises_value_error() -> None:
    with pytest.raises(ValueError, match="ConvergenceDetector"):
        plasticity.ConvergenceDetector(window=3, tolerance=0.1).load_state_dict({"values": []})


@pytest.mark.parametrize(
    ("window", "tolerance", "patience"), [(1, 0.1, 2), (3, 0.0, 2), (3, 0.1, 0)]
)
def test_detector_rejects_out_of_range_settings(
    window: int, tolerance: float, patience: int
) -> None:
    with pytest.raises(ValueError, match="ConvergenceDetector"):
        plasticity.ConvergenceDetector(window, tolerance, patience)
