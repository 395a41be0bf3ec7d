"""Speed-up curves: one least-squares fit per job through all its measured configs.

Each config's measurement is noisy on its own; picking a job's config by its lowest raw point
favours whichever one was measured low by chance (the winner's curse). The fitted curve
pools every point of the job, so the choice follows the job's speed-up, not one draw.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import optimize

from kiln.placement import types

# Reweighting passes: the first weights each point by its own measurement, the later ones by
# the fitted value (a point measured low must not pull the curve down by its larger weight).
PASSES = 3
# A point more than this factor above or below the fitted curve is no timing noise: the
# curve's shape does not describe the job, so it is not used.
MAX_RESIDUAL_FACTOR = 2.0


def fit(configs: Sequence[types.Config]) -> tuple[types.Config, ...]:
    """`configs` with each finite duration replaced by the job's fitted speed-up curve.

    Per GPU type and node count, every parallelism shares a serial term a, a parallel term b
    and a term e that grows with every added device (ring latency, contention), and has a
    bandwidth term of its own (a ring all-reduce moves (k - 1) / k of the gradients; FSDP
    moves more than DDP)::

        seconds(p, k) = a + b / k + [p != single] (c_p (k - 1) / k + e (k - 1)),  all >= 0

    The noise of a measurement is relative (a loaded machine scales a step), so the fit
    minimises relative residuals (non-negative least squares, `scipy.optimize.nnls`,
    reweighted by the fitted values). With no more points than that curve has free terms, e
    is dropped; with no more than that, the group is returned as measured (nothing to pool).
    So is a group with a point more than MAX_RESIDUAL_FACTOR off the curve: it does not
    describe that job. Infinite (infeasible) configs stay infinite; order, parallelisms and
    every other field are kept. Pure.
    """
    out = list(configs)
    groups: dict[tuple[str, int], list[int]] = {}
    for i, config in enumerate(configs):
        if math.isfinite(config.seconds):
            groups.setdefault((config.device_type, config.node_count), []).append(i)
    for members in groups.values():
        fitted = _fit_group([configs[i] for i in members])
        if fitted is not None:
            for i, seconds in zip(members, fitted, strict=True):
                out[i] = dataclasses.replace(configs[i], seconds=seconds)
    return tuple(out)


def _fit_group(configs: Sequence[types.Config]) -> list[float] | None:
    """Fitted seconds of one group's finite configs, or None (kept as measured)."""
    comms = sorted({c.parallelism for c in configs if c.parallelism != "single"})
    design = np.array([[1.0, 1.0 / c.gpus] + [
        (c.gpus - 1) / c.gpus if c.parallelism == p else 0.0 for p in comms]
        + [float(c.gpus - 1) if c.parallelism != "single" else 0.0] for c in configs])
    if len(configs) <= np.linalg.matrix_rank(design):
        design = design[:, :-1]  # too few points for the latency term
    if len(configs) <= np.linalg.matrix_rank(design):
        return None
    measured = np.array([c.seconds for c in configs])
    scale = measured
    for _ in range(PASSES):
        coefficients, _ = optimize.nnls(design / scale[:, None], measured / scale)
        fitted = design @ coefficients
        if not np.all(fitted > 0):
            return None
        scale = fitted
    if np.max(np.abs(np.log(measured / fitted))) > math.log(MAX_RESIDUAL_FACTOR):
        return None
    return [float(s) for s in fitted]
