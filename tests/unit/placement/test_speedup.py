"""`kiln.placement.speedup.fit`: recorded noisy per-config durations -> one fitted curve per
job, and the configuration chosen from it (`types.candidates`) rather than the noise."""

from __future__ import annotations

import math

import pytest

from kiln.placement import speedup, types

TRAFFIC = {"single": 0.0, "ddp": 40.0, "fsdp": 160.0}  # FSDP moves more than DDP


def _curve(parallelism: str, k: int, *, latency: float = 60.0) -> float:
    """100 s serial, 1000 s that divides over k, bandwidth and per-device latency terms."""
    comm = TRAFFIC[parallelism] * (k - 1) / k + latency * (k - 1) if k > 1 else 0.0
    return 100.0 + 1000.0 / k + comm


SHAPES = (("single", 1), ("ddp", 2), ("fsdp", 2), ("ddp", 4), ("fsdp", 4), ("ddp", 8),
          ("fsdp", 8))
# One profile each, a few percent off, as timing one step is; ddp at 8 drew 20% low.
NOISE = {("single", 1): 1.03, ("ddp", 2): 0.97, ("fsdp", 2): 1.02, ("ddp", 4): 1.04,
         ("fsdp", 4): 0.98, ("ddp", 8): 0.80, ("fsdp", 8): 1.03}


def _measured(noise: dict[tuple[str, int], float], *, latency: float = 60.0
              ) -> tuple[types.Config, ...]:
    return tuple(types.Config(p, k, _curve(p, k, latency=latency) * noise[p, k], "profile")
                 for p, k in SHAPES)


def _fastest(configs: tuple[types.Config, ...]) -> types.Config:
    return min(types.candidates(types.JobRequest("job", configs)), key=lambda c: c.seconds)


def test_the_fit_picks_the_truly_fastest_config_where_the_raw_minimum_is_noise() -> None:
    raw = _measured(NOISE)
    assert (_fastest(raw).parallelism, _fastest(raw).gpus) == ("ddp", 8)  # the lucky draw
    fitted = speedup.fit(raw)
    assert (_fastest(fitted).parallelism, _fastest(fitted).gpus) == ("ddp", 4)
    # ... which truly is the fastest, and k = 8 truly is slower than k = 4
    assert min(SHAPES, key=lambda s: _curve(*s)) == ("ddp", 4)

    def error(configs: tuple[types.Config, ...]) -> float:
        return sum(abs(math.log(c.seconds / _curve(c.parallelism, c.gpus))) for c in configs)
    assert error(fitted) < error(raw)
    assert [c.gpus for c in types.candidates(types.JobRequest("job", fitted))] == [1, 2, 4]


def test_the_fit_keeps_the_parallelism_whose_communication_is_cheaper() -> None:
    # At 8, FSDP drew 25% low and DDP 10% high: raw, FSDP wins there; fitted, DDP's cheaper
    # traffic does.
    noise = {**{s: 1.0 for s in SHAPES}, ("fsdp", 8): 0.75, ("ddp", 8): 1.1}
    raw = _measured(noise, latency=0.0)
    at_8 = [c for c in types.candidates(types.JobRequest("job", raw)) if c.gpus == 8]
    assert [c.parallelism for c in at_8] == ["fsdp"]
    fitted = types.candidates(types.JobRequest("job", speedup.fit(raw)))
    assert [c.parallelism for c in fitted if c.gpus in (2, 4, 8)] == ["ddp"] * 3


def test_points_on_the_curve_come_back_unchanged_in_order_with_their_fields() -> None:
    exact = tuple(types.Config(p, k, _curve(p, k), "profile", device_type="cuda:X")
                  for p, k in SHAPES)
    fitted = speedup.fit(exact)
    assert [(c.parallelism, c.gpus, c.source, c.device_type) for c in fitted] == \
        [(c.parallelism, c.gpus, c.source, c.device_type) for c in exact]
    assert [c.seconds for c in fitted] == pytest.approx([c.seconds for c in exact], rel=1e-6)


def test_too_few_points_to_pool_are_returned_as_measured() -> None:
    two = (types.Config("single", 1, 1000.0), types.Config("ddp", 2, 400.0))
    assert speedup.fit(two) == two
    one_per_parallelism = (*two, types.Config("fsdp", 2, 450.0))  # its own traffic term
    assert speedup.fit(one_per_parallelism) == one_per_parallelism


def test_a_point_far_off_any_such_curve_leaves_the_group_as_measured() -> None:
    # k = 4 six times slower than k = 2 and k = 8: no timing noise, the curve does not hold
    odd = (types.Config("single", 1, 1000.0), types.Config("ddp", 2, 500.0),
           types.Config("ddp", 4, 3000.0), types.Config("ddp", 8, 400.0),
           types.Config("fsdp", 2, 520.0))
    assert speedup.fit(odd) == odd


def test_infeasible_configs_stay_infinite_and_gpu_types_are_fitted_apart() -> None:
    slow = tuple(types.Config(p, k, 3.0 * _curve(p, k) * NOISE[p, k], device_type="cuda:A")
                 for p, k in SHAPES)
    fast = tuple(types.Config(p, k, _curve(p, k) * NOISE[p, k], device_type="cuda:B")
                 for p, k in SHAPES)
    oom = types.Config("single", 1, math.inf, device_type="cuda:B")
    fitted = speedup.fit((*slow, oom, *fast))
    assert fitted[len(slow)] == oom
    by_type = {t: [c.seconds for c in fitted if c.device_type == t and math.isfinite(c.seconds)]
               for t in ("cuda:A", "cuda:B")}
    assert by_type["cuda:A"] == pytest.approx([3.0 * s for s in by_type["cuda:B"]], rel=0.05)
