"""kiln_trainer.freezing policy pieces: the prefix decision, the rise test, reference choice.

`Convergence` is fed SP values directly (what the reference worker answers); the reference
choice times real fp32 and int8 copies of a real extractor.
"""

from __future__ import annotations

import torch

from kiln import api, models
from kiln_trainer.freezing import convergence, partition, quantization

BLOCKS = ("stem", "layer1", "layer2", "layer3", "layer4")
SPEC = api.ModelSpec.model_validate(
    {"architecture": "small_cnn", "inputShape": [1, 8, 8], "args": {"depth": 3, "width": 8}}
)


def _cycle(state: convergence.Convergence, values: dict[str, float], *, first_active: int = 0,
           scale: float = 1.0, peaks: bool = True) -> None:
    """One reference cycle of three answers drifting linearly away from the fresh reference
    (so the in-cycle slope test never fires), ending at `values`."""
    for j in (1, 2, 3):
        state.take({k: v * j / 3 for k, v in values.items()}, first_active=first_active,
                   scale=scale)
    state.close_cycle(first_active=first_active, peaks=peaks)
    state.new_cycle()


def _state() -> convergence.Convergence:
    return convergence.Convergence(BLOCKS, window=3, tolerance=1e-9, peak_fraction=0.1,
                                   patience=2)


def test_every_leading_converged_block_joins_one_decision_and_deeper_streaks_survive() -> None:
    state = _state()
    _cycle(state, dict.fromkeys(BLOCKS, 1.0))  # the peaks
    for _ in range(2):  # layer4 still moves; the rest fell to a twentieth
        _cycle(state, {**dict.fromkeys(BLOCKS, 0.05), "layer4": 1.0})
    assert [state.converged(i) for i in range(5)] == [True, True, True, True, False]
    assert state.prefix(0, limit=5, near_free=[False] * 5) == 4
    assert state.prefix(0, limit=2, near_free=[False] * 5) == 2  # the cap
    state.mark_frozen(2)
    assert state.converged(2) and state.converged(3)  # a freeze resets no deeper count
    assert state.prefix(2, limit=5, near_free=[False] * 5) == 4


def test_a_decision_freezes_at_most_its_share_of_the_backward_flops() -> None:
    state = _state()
    _cycle(state, dict.fromkeys(BLOCKS, 1.0))
    for _ in range(2):
        _cycle(state, dict.fromkeys(BLOCKS, 0.05))  # everything converged
    shares = [0.001, 0.2, 0.2, 0.2, 0.2]
    near_free = [True, False, False, False, False]
    # the stem rides along; layer2 would take the decision past 0.35
    assert state.prefix(0, limit=5, near_free=near_free, shares=shares, max_share=0.35) == 2
    assert state.prefix(2, limit=5, near_free=near_free, shares=shares, max_share=0.35) == 3
    # one block always goes, even when it alone is over the cap
    assert state.prefix(0, limit=5, near_free=[False] * 5, shares=[0.5] * 5,
                        max_share=0.35) == 1


def _noisy_phase(state: convergence.Convergence, levels: list[float]) -> None:
    """Cycles at a constant rate whose plasticity moves by `levels` (one per cycle)."""
    for level in levels:
        _cycle(state, dict.fromkeys(BLOCKS, level))


def test_the_phase_test_fires_when_plasticity_stops_falling_at_a_constant_rate() -> None:
    # Scatter about a plateau (what a block does at a high rate once it has learned what that
    # rate allows): neither the slope nor the peak test passes, the phase test does.
    plateau = [1.0, 0.4, 0.9, 0.3, 0.8, 0.5, 1.0, 0.4]
    without = _state()
    _noisy_phase(without, plateau)
    assert not any(without.converged(i) for i in range(5))
    state = convergence.Convergence(BLOCKS, window=3, tolerance=1e-9, peak_fraction=0.1,
                                    patience=2, plateau_ratio=0.5)
    _noisy_phase(state, plateau)
    assert all(state.converged(i) for i in range(5))
    # Still learning: plasticity halves every two cycles, so the test never passes.
    falling = convergence.Convergence(BLOCKS, window=3, tolerance=1e-9, peak_fraction=1e-9,
                                      patience=2, plateau_ratio=0.5)
    _noisy_phase(falling, [1.0, 0.9, 0.45, 0.4, 0.2, 0.18, 0.09, 0.08])
    assert not any(falling.converged(i) for i in range(5))


def test_a_new_phase_starts_the_phase_test_over() -> None:
    state = convergence.Convergence(BLOCKS, window=3, tolerance=1e-9, peak_fraction=1e-9,
                                    patience=1, plateau_ratio=0.5)
    _noisy_phase(state, [1.0, 1.0, 1.0])
    state.new_phase(0)
    _noisy_phase(state, [0.1, 0.1, 0.1])  # three cycles of the new phase: not yet four
    assert not state.converged(1)
    _noisy_phase(state, [0.1])
    assert state.converged(1)


def test_a_near_free_block_joins_the_next_converged_one_and_never_goes_alone() -> None:
    state = _state()
    _cycle(state, dict.fromkeys(BLOCKS, 1.0))
    for _ in range(2):  # the stem still moves, layer1 converged, layer2 not
        _cycle(state, {"stem": 1.0, "layer1": 0.05, "layer2": 1.0, "layer3": 1.0,
                       "layer4": 1.0})
    near_free = [True, False, False, False, False]
    assert state.prefix(0, limit=4, near_free=near_free) == 2  # stem with layer1
    assert state.prefix(0, limit=4, near_free=[False] * 5) == 0  # the stem blocks it
    lone = _state()
    _cycle(lone, dict.fromkeys(BLOCKS, 1.0))
    for _ in range(2):  # only the stem converged: freezing it alone would save nothing
        _cycle(lone, {**dict.fromkeys(BLOCKS, 1.0), "stem": 0.05})
    assert lone.converged(0) and lone.prefix(0, limit=4, near_free=near_free) == 0


def test_a_learning_rate_drop_alone_is_no_rise_and_no_new_peak() -> None:
    state = _state()
    _cycle(state, dict.fromkeys(BLOCKS, 1.0), scale=0.1)  # peak 10 per unit of lr x steps
    for _ in range(2):
        _cycle(state, dict.fromkeys(BLOCKS, 0.05), scale=0.1)
    state.mark_frozen(2)
    # lr / 10: raw plasticity falls 10-25x, per unit of lr it falls up to 2.5x, still converged
    for _ in range(3):
        _cycle(state, dict.fromkeys(BLOCKS, 0.002), first_active=2, scale=0.01)
    assert state.converged(2) and state.converged(3) and not state.risen(2)
    # a drop where plasticity falls less than the rate (BatchNorm statistics): the new phase
    # takes a new baseline instead of calling it a rise
    state.new_phase(2)
    for _ in range(3):
        _cycle(state, dict.fromkeys(BLOCKS, 0.001), first_active=2, scale=0.001)
    assert not state.risen(2)


def test_a_measured_rise_behind_the_prefix_takes_patience_cycles() -> None:
    state = _state()
    _cycle(state, dict.fromkeys(BLOCKS, 1.0))
    for _ in range(2):
        _cycle(state, dict.fromkeys(BLOCKS, 0.05))
    state.mark_frozen(2)  # baseline of layer2: 0.05
    _cycle(state, dict.fromkeys(BLOCKS, 0.1), first_active=2)  # 2x: scatter, not a rise
    assert not state.risen(2)
    _cycle(state, dict.fromkeys(BLOCKS, 0.2), first_active=2)  # 4x, once
    assert not state.risen(2)
    _cycle(state, dict.fromkeys(BLOCKS, 0.2), first_active=2)  # 4x, twice: patience 2
    assert state.risen(2)
    state.mark_unfrozen(0)
    assert not state.risen(2) and not state.converged(0)


def test_convergence_state_round_trips_and_ignores_other_blocks() -> None:
    state = _state()
    _cycle(state, dict.fromkeys(BLOCKS, 1.0))
    for _ in range(2):
        _cycle(state, dict.fromkeys(BLOCKS, 0.05))
    restored = _state()
    restored.load_state_dict(state.state_dict())
    assert [restored.converged(i) for i in range(5)] == [True] * 5
    other = convergence.Convergence(BLOCKS[:3], window=3, tolerance=1e-9, peak_fraction=0.1,
                                    patience=2)
    other.load_state_dict(state.state_dict())
    assert not any(other.converged(i) for i in range(3))


def test_the_reference_kind_is_the_one_measured_cheaper() -> None:
    torch.manual_seed(0)
    model = models.build(SPEC).eval()
    blocks = models.natural_blocks(model)
    extractor = partition.extractor(model, blocks)
    calibration = torch.randn(16, 1, 8, 8)
    copy, kind, floor, seconds = quantization.choose(extractor, calibration)
    assert quantization.Kind.FP32 in seconds and len(seconds) == 2  # both were timed
    assert kind == min(seconds, key=lambda k: seconds[k])
    assert floor == ({} if kind == quantization.Kind.FP32 else floor)
    got = quantization.outputs(copy, calibration)
    assert set(got) == set(blocks[:-1])
    # the chosen kind is what later refreshes ask for; it is rebuilt without a new contest
    again, again_kind, _ = quantization.quantize_with_floor(extractor, calibration, mode=kind)
    assert again_kind == kind and set(quantization.outputs(again, calibration)) == set(got)


def test_a_warm_up_sets_no_peak_the_full_rate_has_to_beat() -> None:
    state = _state()
    # During a warm-up the rate is a hundredth of the full one: per unit of learning rate
    # the same drift looks a hundred times as plastic.
    _cycle(state, dict.fromkeys(BLOCKS, 1.0), scale=0.01)
    for _ in range(2):  # at the full rate, the same blocks, still learning
        _cycle(state, dict.fromkeys(BLOCKS, 1.0))
    assert all(state.converged(i) for i in range(5))  # what the warm-up's peak did
    state.rate_rose()
    for _ in range(2):
        _cycle(state, dict.fromkeys(BLOCKS, 1.0))
    assert not any(state.converged(i) for i in range(5))
    assert state.prefix(0, limit=5, near_free=[False] * 5) == 0


def test_the_cycles_of_the_bootstrap_set_no_peak_and_a_loss_plateau_is_not_convergence() -> None:
    # Normalised plasticity of a 1-layer character transformer's two blocks, cycle by cycle
    # (recorded from `kiln run`, lr 0.0034, cosine): the first cycle leaves the random
    # initialisation 40-400x faster than any later one, then the loss sits on its unigram
    # plateau while the blocks keep learning at a steady pace.
    blocks = ("stem", "layers.0")
    trace = [(4.19e-05, 0.0093), (2.59e-06, 2.29e-05), (9.45e-06, 1.15e-04),
             (7.13e-06, 1.43e-04), (6.5e-06, 2.16e-04), (3.98e-06, 1.28e-04),
             (3.39e-06, 7.2e-05), (3.13e-06, 5.57e-05), (2.28e-06, 4.1e-05)]
    bootstrap = 2  # cycles before the bootstrap steps ended

    def run(peaks_from: int) -> list[bool]:
        state = convergence.Convergence(blocks, window=3, tolerance=1e-9, peak_fraction=0.1,
                                        patience=2)
        converged = []
        for n, values in enumerate(trace):
            _cycle(state, dict(zip(blocks, values, strict=True)), peaks=n >= peaks_from)
            converged.append(state.converged(1))
        return converged

    assert run(peaks_from=0)[2:] == [True] * 7  # what the first cycle's peak did: froze it
    assert run(peaks_from=bootstrap) == [False] * 9
