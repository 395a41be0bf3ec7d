"""Per-block convergence of plasticity across reference cycles (Egeria's freezing test).

A *cycle* is the stretch between two refreshes of the reference model. This module only says
which blocks converged; which block freezes is `freezing.controller`'s decision.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kiln_trainer.freezing import plasticity

EMA_ALPHA = 0.8  # weight of the history in the per-cycle smoothing (Egeria uses 0.8-0.9)
#: A frozen prefix thaws when the block behind it moves this many times faster per unit of
#: learning rate than when the prefix froze: well above the cycle-to-cycle scatter.
RISE_FACTOR = 3.0
#: The phase test compares the median of a block's last this-many cycles of the learning-rate
#: phase with the median of the this-many before them.
PLATEAU_CYCLES = 2


class Convergence:
    """Convergence state of the freezable blocks (all but the head), in forward order.

    Each block's answers are EMA-smoothed (`plasticity.Ema`) and fed to a windowed slope test
    (`plasticity.ConvergenceDetector`, window = the cycle); `close_cycle` applies the slope and
    peak tests and keeps a streak of converged cycles per block. The peak test compares
    plasticity per unit of learning rate and per step since the refresh (`take`'s `scale`), so
    a learning-rate drop neither restarts the baseline nor makes a converged block look new.

    Args:
        blocks: names of the freezable blocks.
        window: answers per cycle (the slope test's window).
        tolerance: the slope test's threshold on the normalised slope (dimensionless).
        peak_fraction: the peak test's threshold, a fraction of the block's peak plasticity.
        patience: converged cycles in a row before a block counts as converged.
    """

    def __init__(self, blocks: Sequence[str], *, window: int, tolerance: float,
                 peak_fraction: float, patience: int, plateau_ratio: float = 0.0) -> None:
        self.blocks, self.patience = tuple(blocks), patience
        self.tolerance, self.peak_fraction = tolerance, peak_fraction
        self.plateau_ratio = plateau_ratio
        # normalised plasticity of each closed cycle of the current learning-rate phase
        self._phase: list[list[float]] = [[] for _ in self.blocks]
        self._passed: list[str | None] = [None for _ in self.blocks]  # the test that held
        self._emas = [plasticity.Ema(EMA_ALPHA) for _ in self.blocks]
        self._detectors = [plasticity.ConvergenceDetector(window, tolerance, 1)
                           for _ in self.blocks]
        self._scales = [0.0 for _ in self.blocks]  # lr x steps since the refresh, last answer
        self._peaks = [0.0 for _ in self.blocks]  # highest normalised cycle plasticity
        self._streaks = [0 for _ in self.blocks]  # converged cycles in a row
        self._rises = [0 for _ in self.blocks]  # cycles in a row above RISE_FACTOR x baseline
        self._baselines: list[float | None] = [None for _ in self.blocks]
        self._awaiting: int | None = None  # block whose baseline the next cycle sets
        self.plasticity: dict[str, float] = {}  # latest smoothed value per block
        self.normalised: dict[str, float] = {}  # its value per unit of lr x steps, at cycle end

    def take(self, values: Mapping[str, float], *, first_active: int,
             scale: float = 1.0) -> None:
        """Fold in one answer of the reference (SP loss per block) for the active blocks.

        Args:
            values: SP loss per block.
            first_active: index of the front-most trainable block.
            scale: learning rate x optimizer steps since the reference was refreshed, the
                drift the answer reflects; the peak test divides by it (> 0; 1.0: raw values).
        """
        for i in range(first_active, len(self.blocks)):
            name = self.blocks[i]
            if name in values:
                self.plasticity[name] = self._emas[i].update(values[name])
                self._detectors[i].add(self.plasticity[name])
                self._scales[i] = scale

    def close_cycle(self, *, first_active: int, peaks: bool = True) -> None:
        """End a cycle: update every measured active block's streak, peak and rise count.

        Args:
            first_active: index of the front-most trainable block.
            peaks: whether this cycle's plasticity may set a block's peak. Not in the
                bootstrap: a network leaving its random initialisation moves tens to hundreds
                of times faster per unit of learning rate than at any later point (measured on
                a character transformer: 400x in the first cycle), so a peak from then made
                every later cycle pass the peak test, a loss plateau included.
        """
        for i in range(first_active, len(self.blocks)):
            name = self.blocks[i]
            value = self.plasticity.get(name)
            if value is None or self._emas[i].value is None or self._scales[i] <= 0:
                continue  # not measured in this cycle
            normalised = value / self._scales[i]
            self.normalised[name] = normalised
            change = self._detectors[i].last_change
            if peaks:
                self._peaks[i] = max(self._peaks[i], normalised)
            # Converged when either test holds. The slope test: plasticity stopped growing
            # within the cycle (the drift since the refresh is lost in the noise). The peak
            # test: the normalised cycle plasticity fell to `peak_fraction` of its peak. It is
            # scale-free like the first and, unlike it, does not wait for the learning rate to
            # vanish: measured on digits, the slope test alone fired only in the last tenth of a
            # cosine schedule, because a block that still moves drifts linearly away from a
            # fresh snapshot.
            phase = self._phase[i]
            phase.append(normalised)
            tests = {"slope": change is not None and change < self.tolerance,
                     "peak": 0 < self._peaks[i]
                     and normalised <= self.peak_fraction * self._peaks[i],
                     "phase": self._settled(phase)}
            self._passed[i] = next((name for name, passed in tests.items() if passed), None)
            flat = self._passed[i] is not None
            self._streaks[i] = self._streaks[i] + 1 if flat else 0
            if i == self._awaiting and self._baselines[i] is None:
                self._baselines[i], self._awaiting = normalised, None
                continue  # the baseline's own cycle
            baseline = self._baselines[i]
            risen = baseline is not None and normalised > RISE_FACTOR * max(baseline, 1e-300)
            self._rises[i] = self._rises[i] + 1 if risen else 0

    def _settled(self, phase: Sequence[float]) -> bool:
        """The phase test: plasticity stopped falling within the learning-rate phase.

        At a constant high rate a block that learned what the rate lets it learn keeps
        drifting with the gradient noise, so neither its slope nor its distance to the peak
        ever passes; what ends is the fall. Medians of `PLATEAU_CYCLES` cycles, because one
        cycle's plasticity scatters severalfold around that plateau (measured on a ResNet-20).
        """
        n = PLATEAU_CYCLES
        if not self.plateau_ratio or len(phase) < 2 * n:
            return False
        return statistics.median(phase[-n:]) >= \
            self.plateau_ratio * statistics.median(phase[-2 * n:-n])

    def converged(self, i: int) -> bool:
        """Whether block `i` converged in its last `patience` cycles."""
        return self._streaks[i] >= self.patience

    def prefix(self, first_active: int, limit: int, near_free: Sequence[bool],
               shares: Sequence[float] | None = None, max_share: float = 1.0) -> int:
        """The boundary after freezing the converged blocks in front, in one decision.

        Scans from `first_active`: a converged block extends the prefix; a near-free block
        (`near_free[i]`, a sliver of the backward FLOPs) neither needs to converge nor extends
        it alone, it joins the next converged block; any other block ends the scan, and so
        does reaching `max_share` of the backward FLOPs in this decision (at least one block
        freezes): the rest may freeze at the next cycle's decision, their streaks kept.

        Args:
            first_active: the current boundary.
            limit: the most blocks that may be frozen.
            near_free: per block, whether freezing it saves next to nothing.
            shares: per block, its share of the backward FLOPs (None: no cap).
            max_share: the most of the backward FLOPs one decision freezes.

        Returns:
            The new boundary, `first_active` when nothing more freezes.
        """
        boundary, taken = first_active, 0.0
        for i in range(first_active, min(limit, len(self.blocks))):
            if shares is not None and boundary > first_active \
                    and taken + shares[i] > max_share + 1e-9:
                break
            if self.converged(i) and not near_free[i]:
                boundary = i + 1
            elif not (self.converged(i) or near_free[i]):
                break
            taken += shares[i] if shares is not None else 0.0
        return boundary

    def rate_rose(self) -> None:
        """The learning rate rose (a warm-up, a restart): peaks and streaks start over.

        Per unit of learning rate, a cycle at a tenth of the rate looks ten times as plastic,
        so a peak taken during a warm-up made every block pass the peak test the moment the
        warm-up ended (measured: a ResNet-20 froze 80% of its blocks at that step and ended
        2.3 points below full training). For the same reason a rise baseline taken at the
        lower rate is retaken (a prefix frozen at step 0 of a warm-up would otherwise be
        measured against a baseline no later cycle can exceed threefold)."""
        self._peaks = [0.0 for _ in self.blocks]
        self._streaks = [0 for _ in self.blocks]
        self._phase = [[] for _ in self.blocks]
        watched = next((i for i, b in enumerate(self._baselines) if b is not None),
                       self._awaiting)
        if watched is not None:
            self._baselines[watched], self._rises[watched] = None, 0
            self._awaiting = watched

    def mark_frozen(self, boundary: int) -> None:
        """A prefix of `boundary` blocks froze: the next block's normalised plasticity, in the
        decision's cycle (else the next cycle), becomes the baseline its later rise is measured
        against. The deeper blocks' streaks are kept."""
        self._baselines = [None for _ in self.blocks]
        self._rises = [0 for _ in self.blocks]
        if boundary < len(self.blocks):
            self._baselines[boundary] = self.normalised.get(self.blocks[boundary])
            self._awaiting = boundary

    def risen(self, i: int) -> bool:
        """Whether block `i`'s normalised plasticity stayed above `RISE_FACTOR` times its
        baseline (`mark_frozen`) for `patience` cycles in a row."""
        return self._rises[i] >= self.patience

    def new_phase(self, first_active: int) -> None:
        """The learning rate dropped: the rise test takes a new baseline in the next cycle.

        Per unit of learning rate, plasticity does not fall exactly in step with the rate (the
        BatchNorm statistics move at any rate), so a baseline from before the drop would see a
        rise where nothing changed; peaks and streaks are kept."""
        self._baselines = [None for _ in self.blocks]
        self._rises = [0 for _ in self.blocks]
        self._awaiting = first_active if first_active else None
        self._phase = [[] for _ in self.blocks]

    def mark_unfrozen(self, first: int) -> None:
        """Blocks from `first` on were unfrozen: their streaks start over (peaks are kept)."""
        for i in range(first, len(self.blocks)):
            self._streaks[i] = 0
            self._phase[i] = []
        self._baselines = [None for _ in self.blocks]
        self._rises = [0 for _ in self.blocks]
        self._awaiting = None

    def new_cycle(self) -> None:
        """The reference was refreshed: no window or average straddles the refresh."""
        for detector, ema in zip(self._detectors, self._emas, strict=True):
            detector.drop_partial_window()
            ema.reset()

    def reason(self, i: int) -> str | None:
        """Why block `i` counts as converged, in words; None without a measurement."""
        name = self.blocks[i]
        value = self.normalised.get(name)
        if value is None or not self._peaks[i]:
            return None
        passed, n, phase = self._passed[i], PLATEAU_CYCLES, self._phase[i]
        if passed == "phase":
            ratio = statistics.median(phase[-n:]) / max(statistics.median(phase[-2 * n:-n]),
                                                         1e-300)
            how = (f"stopped falling in this learning-rate phase (its last {n} cycles "
                   f"{ratio:.2f}x the {n} before, per unit of learning rate)")
        elif passed == "slope":
            how = "stopped growing within the cycle"
        else:
            how = (f"fell to {value / self._peaks[i]:.2f} of its peak per unit of learning "
                   "rate")
        return (f"plasticity {self.plasticity[name]:.2g} {how}, converged for "
                f"{self.patience} reference cycles")

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints: peaks, streaks and baselines per block."""
        return {"blocks": list(self.blocks), "peaks": list(self._peaks),
                "streaks": list(self._streaks), "baselines": list(self._baselines)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output; ignored (measured afresh) for other blocks."""
        if list(state.get("blocks", [])) != list(self.blocks):
            return
        self._peaks = [float(v) for v in state["peaks"]]
        self._streaks = [int(v) for v in state["streaks"]]
        self._baselines = [None if v is None else float(v) for v in state["baselines"]]

    def __str__(self) -> str:
        return "; ".join(
            f"{name} {self.plasticity[name]:.3g} (normalised {self.normalised.get(name, 0):.3g}"
            f", peak {peak:.3g}, slope "
            f"{'-' if d.last_change is None else f'{d.last_change:.3g}'}, streak {streak})"
            for name, peak, d, streak in zip(self.blocks, self._peaks, self._detectors,
                                             self._streaks, strict=True)
            if name in self.plasticity)

