"""Per-block convergence of plasticity across reference cycles (Egeria's freezing test).

A *cycle* is the stretch between two refreshes of the reference model. This module only says
which blocks converged; which block freezes is `freezing.controller`'s decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kiln_trainer.freezing import plasticity

EMA_ALPHA = 0.8  # weight of the history in the per-cycle smoothing (Egeria uses 0.8-0.9)


class Convergence:
    """Convergence state of the freezable blocks (all but the head), in forward order.

    Each block's answers are EMA-smoothed (`plasticity.Ema`) and fed to a windowed slope test
    (`plasticity.ConvergenceDetector`, window = the cycle); `close_cycle` applies the slope and
    peak tests.

    Args:
        blocks: names of the freezable blocks.
        window: answers per cycle (the slope test's window).
        tolerance: the slope test's threshold on the normalised slope (dimensionless).
        peak_fraction: the peak test's threshold, a fraction of the block's peak plasticity.
        patience: converged cycles in a row before `close_cycle` reports True.
    """

    def __init__(self, blocks: Sequence[str], *, window: int, tolerance: float,
                 peak_fraction: float, patience: int) -> None:
        self.blocks, self.patience = tuple(blocks), patience
        self.tolerance, self.peak_fraction = tolerance, peak_fraction
        self._emas = [plasticity.Ema(EMA_ALPHA) for _ in self.blocks]
        self._detectors = [plasticity.ConvergenceDetector(window, tolerance, 1)
                           for _ in self.blocks]
        self._peaks = [0.0 for _ in self.blocks]  # highest cycle plasticity since the last reset
        self._streaks = [0 for _ in self.blocks]  # converged cycles in a row
        self.plasticity: dict[str, float] = {}  # latest smoothed value per block

    def take(self, values: Mapping[str, float], *, first_active: int) -> None:
        """Fold in one answer of the reference (SP loss per block) for the active blocks."""
        for i in range(first_active, len(self.blocks)):
            name = self.blocks[i]
            if name in values:
                self.plasticity[name] = self._emas[i].update(values[name])
                self._detectors[i].add(self.plasticity[name])

    def close_cycle(self, *, first_active: int) -> bool:
        """End a cycle: update every active block's streak; whether the front-most active block
        (index `first_active`) has now converged for `patience` cycles in a row."""
        for i in range(first_active, len(self.blocks)):
            value = self.plasticity.get(self.blocks[i])
            if value is None:
                continue
            change = self._detectors[i].last_change
            self._peaks[i] = max(self._peaks[i], value)
            # Converged when either test holds. The slope test: plasticity stopped growing
            # within the cycle (the drift since the refresh is lost in the quantization noise).
            # The peak test: the cycle plasticity fell to `peak_fraction` of its peak. It is
            # scale-free like the first and, unlike it, does not wait for the learning rate to
            # vanish: measured on digits, the slope test alone fired only in the last tenth of a
            # cosine schedule, because a block that still moves drifts linearly away from a
            # fresh snapshot.
            flat = (change is not None and change < self.tolerance) or \
                value <= self.peak_fraction * self._peaks[i]
            self._streaks[i] = self._streaks[i] + 1 if flat else 0
        return first_active < len(self.blocks) and \
            self._streaks[first_active] >= self.patience

    def new_cycle(self) -> None:
        """The reference was refreshed: no window or average straddles the refresh."""
        for detector, ema in zip(self._detectors, self._emas, strict=True):
            detector.drop_partial_window()
            ema.reset()

    def reset(self, *, forget_peaks: bool) -> None:
        """The frozen boundary moved: streaks start over; after an unfreeze (a learning-rate
        event) the peaks are forgotten too, so plasticity is measured afresh."""
        for i, detector in enumerate(self._detectors):
            detector.reset()
            self._emas[i].reset()
            self._streaks[i] = 0
            if forget_peaks:
                self._peaks[i] = 0.0

    def reason(self, i: int) -> str | None:
        """Why block `i` counts as converged, in words; None without a measurement."""
        value = self.plasticity.get(self.blocks[i])
        if value is None or not self._peaks[i]:
            return None
        return (f"plasticity {value:.2g} ({value / self._peaks[i]:.2f} of its peak), converged "
                f"for {self.patience} reference cycles")

    def __str__(self) -> str:
        return "; ".join(
            f"{name} {self.plasticity[name]:.3g} (peak {peak:.3g}, slope "
            f"{'-' if d.last_change is None else f'{d.last_change:.3g}'}, streak {streak})"
            for name, peak, d, streak in zip(self.blocks, self._peaks, self._detectors,
                                             self._streaks, strict=True)
            if name in self.plasticity)
