"""Plasticity for layer freezing, as pure math: the SP loss, its EMA, and a windowed flatness test.

Egeria (Wang et al., EuroSys'23, section 3) measures how much a block's representation still
moves by the similarity-preserving (SP) loss (Tung & Mori, ICCV'19, section 3, eq. 2-4). No
freezing policy here. Shapes: b probe batch (rows), d flattened features per sample.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

_log = logging.getLogger(__name__)


def sp_loss(a: torch.Tensor, r: torch.Tensor) -> float:
    """Similarity-preserving loss between two activations of the same b samples.

    Tung & Mori, "Similarity-Preserving Knowledge Distillation", ICCV 2019, section 3 (eq. 2-4),
    as Egeria's plasticity (Wang et al., EuroSys 2023, section 3): flatten each sample to a row,
    giving A [b, d_a] and R [b, d_r]; form the Gram matrices G_A = A A^T and G_R = R R^T [b, b];
    L2-normalise each row; return ||G^_A - G^_R||_F^2 / b^2. Computed in float64.

    Properties (tested): SP(A, A) = 0; SP(A, R) = SP(R, A); invariant to a positive global
    scale of either side (c * A, c > 0) and to any orthogonal transform of the flattened
    features (e.g. a channel permutation), since G_A is; 0 <= SP <= 4/b (each normalised row
    difference has squared norm <= 4), and <= 2/b when both sides are non-negative (post-ReLU:
    Gram entries >= 0, so normalised rows have a non-negative dot product). Because the bound
    scales with 1/b, compare values only at a fixed probe batch size. A sample whose activation
    is all zeros has a zero Gram row, which stays zero. Non-finite inputs give a non-finite
    result.

    Args:
        a: Tensor[b, ...] (training side), any float dtype and device.
        r: Tensor[b, ...] (reference side), same b, any trailing shape.

    Returns:
        The SP loss, a float in [0, 4/b].

    Raises:
        ValueError: `a` and `r` differ in their first dimension b, b < 2, or a tensor has no
            dimensions.
    """
    if a.dim() == 0 or r.dim() == 0:
        raise ValueError(f"sp_loss needs Tensor[b, ...] inputs (got {a.dim()}-d and {r.dim()}-d)")
    if a.shape[0] != r.shape[0]:
        raise ValueError(
            f"sp_loss needs the same samples on both sides (got b = {a.shape[0]} and "
            f"{r.shape[0]})"
        )
    b = a.shape[0]
    if b < 2:
        raise ValueError(f"sp_loss needs a batch of at least 2 samples (got b = {b})")
    gram_a = _normalised_gram(a)
    gram_r = _normalised_gram(r.to(gram_a.device))
    return float(((gram_a - gram_r) ** 2).sum() / (b * b))


def _normalised_gram(t: torch.Tensor) -> torch.Tensor:
    """Tensor[b, ...] -> row-L2-normalised Gram matrix Tensor[b, b] float64."""
    rows = t.detach().reshape(t.shape[0], -1).to(torch.float64)
    return F.normalize(rows @ rows.T, p=2.0, dim=1)


class Ema:
    """Exponential moving average: value <- alpha * value + (1 - alpha) * x (first x as is).

    Egeria smooths each block's plasticity before the convergence test (alpha 0.8-0.9 weighs
    the history).

    Args:
        alpha: weight of the history, in [0, 1); 0 means no smoothing.

    Raises:
        ValueError: `alpha` outside [0, 1).
    """

    def __init__(self, alpha: float) -> None:
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"Ema alpha must be in [0, 1) (got {alpha})")
        self.alpha = float(alpha)
        self._value: float | None = None

    @property
    def value(self) -> float | None:
        """The current average; None before the first `update` (or after `reset`)."""
        return self._value

    def update(self, x: float) -> float:
        """Fold in one observation and return the new average.

        Raises:
            ValueError: `x` is not finite (NaN or infinite).
        """
        if not math.isfinite(x):
            raise ValueError(f"Ema.update needs a finite value (got {x})")
        if self._value is None:
            self._value = float(x)
        else:
            self._value = self.alpha * self._value + (1.0 - self.alpha) * float(x)
        return self._value

    def reset(self) -> None:
        """Forget the history: the next `update` starts afresh."""
        self._value = None


def normalised_change(values: Sequence[float]) -> float:
    """|slope| * W / |mean| of a window of W values: the fitted relative change over the window.

    The slope is the ordinary least-squares fit of the values against their index 0 .. W-1
    (units: value per probe), so |slope| * W is the change the fit predicts over the window,
    relative to the window's mean (Egeria's "normalised change").

    Args:
        values: W >= 2 values, in the order observed.

    Returns:
        A non-negative float; 0.0 for a window of zeros, infinity for a zero mean with a
        non-zero slope.

    Raises:
        ValueError: fewer than 2 values.
    """
    w = len(values)
    if w < 2:
        raise ValueError(f"a slope needs at least 2 values (got {w})")
    mean_x = (w - 1) / 2.0
    mean_y = math.fsum(values) / w
    covariance = math.fsum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    variance = math.fsum((i - mean_x) ** 2 for i in range(w))
    change = abs(covariance / variance) * w
    if mean_y == 0.0:
        return 0.0 if change == 0.0 else math.inf
    return change / abs(mean_y)


class ConvergenceDetector:
    """Is a block's smoothed plasticity flat? Egeria's windowed convergence test.

    Values are cut into consecutive, non-overlapping windows of `window` values. At the end of
    each window the `normalised_change` (|slope| * W / |mean|) is compared with `tolerance`;
    the detector reports convergence once that change stayed below the tolerance for
    `patience` completed windows in a row (Egeria, EuroSys'23, section 3: W = 8-10, tolerance
    0.05-0.10, patience 2). A non-finite value resets the detector: a
    diverging model never freezes. The caller passes values already smoothed (`Ema`).

    Args:
        window: W, values per window, >= 2.
        tolerance: threshold on the normalised change, > 0.
        patience: consecutive flat windows needed, >= 1.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, window: int, tolerance: float, patience: int = 2) -> None:
        if window < 2:
            raise ValueError(f"ConvergenceDetector window must be >= 2 (got {window})")
        if not tolerance > 0.0:
            raise ValueError(f"ConvergenceDetector tolerance must be > 0 (got {tolerance})")
        if patience < 1:
            raise ValueError(f"ConvergenceDetector patience must be >= 1 (got {patience})")
        self.window, self.tolerance, self.patience = int(window), float(tolerance), int(patience)
        self._values: list[float] = []
        self._flat_windows = 0
        self.last_change: float | None = None  # normalised change of the last completed window

    @property
    def converged(self) -> bool:
        """Whether the last `patience` completed windows were all flat."""
        return self._flat_windows >= self.patience

    def add(self, value: float) -> bool:
        """Append one smoothed plasticity value.

        Args:
            value: a smoothed SP loss (dimensionless).

        Returns:
            `converged` after this value: True once `patience` windows in a row were flat,
            and while later windows stay flat.
        """
        if not math.isfinite(value):
            _log.info("plasticity %s is not finite; the convergence history restarts", value)
            self.reset()
            return False
        self._values.append(float(value))
        if len(self._values) == self.window:
            self.last_change = normalised_change(self._values)
            flat = self.last_change < self.tolerance
            self._flat_windows = self._flat_windows + 1 if flat else 0
            self._values = []
        return self.converged

    def drop_partial_window(self) -> None:
        """Discard the values of the unfinished window, keeping the run of flat windows (so no
        window straddles a reference refresh)."""
        self._values = []

    def reset(self) -> None:
        """Forget everything: partial window, flat-window run and last change."""
        self._values = []
        self._flat_windows = 0
        self.last_change = None

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints (plain ints, floats, lists; no NaN or infinity)."""
        last = self.last_change
        return {
            "window": self.window,
            "tolerance": self.tolerance,
            "patience": self.patience,
            "values": list(self._values),
            "flat_windows": self._flat_windows,
            "last_change": last if last is not None and math.isfinite(last) else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output. The constructor's window, tolerance and patience win
        over the checkpoint's; a different window drops the saved partial window (logged).

        Raises:
            ValueError: `state` lacks a key or holds a value of the wrong type.
        """
        try:
            values = [float(v) for v in state["values"]]
            flat_windows = int(state["flat_windows"])
            last = state["last_change"]
            last_change = None if last is None else float(last)
            saved = (int(state["window"]), float(state["tolerance"]), int(state["patience"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a ConvergenceDetector state ({error!r}): {state!r}") from error
        if saved != (self.window, self.tolerance, self.patience):
            _log.warning(
                "convergence settings changed since the checkpoint (window, tolerance, patience "
                "%s -> %s); the job's values win",
                saved, (self.window, self.tolerance, self.patience),
            )
        if saved[0] != self.window:
            values = []
        self._values = values[: self.window - 1]
        self._flat_windows = flat_windows
        self.last_change = last_change
