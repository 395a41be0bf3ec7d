"""Introspection: which running jobs grow, shrink or move, and when hysteresis holds them."""

from __future__ import annotations

import pytest

from kiln.placement import introspect, types

# Devices taken while idle are free here (grow_price 0); its own tests price them.
POLICY = introspect.Policy(min_gain=2.0, min_interval_seconds=300.0,
                           default_restart_seconds=60.0, grow_price=0.0)
# A job that scales well: 1000 s on 1 device, 520 s on 2, 280 s on 4.
SCALING = (types.Config("single", 1, 1000.0), types.Config("ddp", 2, 520.0),
           types.Config("ddp", 4, 280.0))


def _snapshot(running: tuple[types.Running, ...], *, nodes: tuple[types.Node, ...] = (
        types.Node("a", 2),), queued: tuple[types.JobRequest, ...] = (),
              now: float = 1000.0) -> types.Snapshot:
    return types.Snapshot(now=now, nodes=nodes, queued=queued, running=running)


def _state(**overrides: object) -> introspect.JobState:
    fields: dict[str, object] = {"configs": SCALING}
    fields.update(overrides)
    return introspect.JobState(**fields)  # type: ignore[arg-type]


def test_a_job_grows_into_devices_a_finished_job_freed() -> None:
    running = (types.Running("ns/a", "a", 1, "single", 800.0),)
    (move,) = introspect.propose(_snapshot(running), {"ns/a": _state()}, POLICY)
    assert (move.kind, move.node, move.gpus, move.parallelism) == ("grow", "a", 2, "ddp")
    assert move.remaining_seconds == pytest.approx(800 * 520 / 1000 + 60)
    assert move.gain_seconds == pytest.approx(800 - 800 * 520 / 1000 - 60)


def test_no_move_when_the_saving_does_not_beat_the_restart_cost_by_min_gain() -> None:
    # 100 s left: growing saves 48 s, less than 2 x 60 s of restart.
    running = (types.Running("ns/a", "a", 1, "single", 100.0),)
    assert introspect.propose(_snapshot(running), {"ns/a": _state()}, POLICY) == ()
    # A measured fast restart makes the same move worth it.
    fast = _state(restart_seconds=5.0)
    (move,) = introspect.propose(_snapshot(running), {"ns/a": fast}, POLICY)
    assert move.restart_seconds == 5.0


def test_hysteresis_holds_a_job_that_moved_recently() -> None:
    running = (types.Running("ns/a", "a", 1, "single", 800.0),)
    recent = _state(last_move=900.0)  # 100 s ago, the interval is 300 s
    assert introspect.propose(_snapshot(running), {"ns/a": recent}, POLICY) == ()
    assert introspect.propose(_snapshot(running, now=1200.0), {"ns/a": recent}, POLICY)
    # A job that never moved may move at once.
    assert introspect.propose(_snapshot(running, now=0.0), {"ns/a": _state()}, POLICY)


def test_free_devices_a_queued_job_can_start_on_are_not_taken() -> None:
    running = (types.Running("ns/a", "a", 1, "single", 800.0),)
    queued = (types.JobRequest("ns/q", (types.Config("single", 1, 500.0),)),)
    assert introspect.propose(_snapshot(running, queued=queued), {"ns/a": _state()},
                              POLICY) == ()


def test_a_job_moves_to_a_node_where_it_runs_faster() -> None:
    nodes = (types.Node("a", 1), types.Node("b", 4))
    running = (types.Running("ns/a", "a", 1, "single", 800.0),)
    (move,) = introspect.propose(_snapshot(running, nodes=nodes), {"ns/a": _state()}, POLICY)
    assert (move.kind, move.from_node, move.node, move.gpus) == ("move", "a", "b", 4)


def test_a_frozen_job_shrinks_so_a_waiting_job_starts() -> None:
    # Freezing cut its compute to a tenth: 2 devices barely beat 1 now.
    running = (types.Running("ns/big", "a", 2, "ddp", 1000.0),)
    queued = (types.JobRequest("ns/q", (types.Config("single", 1, 600.0),)),)
    frozen = _state(compute_scale=0.1)
    (move,) = introspect.propose(_snapshot(running, queued=queued), {"ns/big": frozen}, POLICY)
    assert (move.kind, move.gpus, move.helped) == ("shrink", 1, ("ns/q",))
    # Without freezing, halving its devices costs it more than the waiting job gains.
    assert introspect.propose(_snapshot(running, queued=queued), {"ns/big": _state()},
                              POLICY) == ()


def test_two_jobs_never_count_on_the_same_free_devices() -> None:
    nodes = (types.Node("a", 4),)
    running = (types.Running("ns/x", "a", 1, "single", 800.0),
               types.Running("ns/y", "a", 1, "single", 900.0))
    moves = introspect.propose(_snapshot(running, nodes=nodes),
                               {"ns/x": _state(), "ns/y": _state()}, POLICY)
    assert sum(m.gpus - m.from_gpus for m in moves) <= 2
    assert moves[0].job == "ns/y"  # the larger saving first


def test_a_job_without_state_or_config_at_its_count_stays() -> None:
    running = (types.Running("ns/a", "a", 1, "single", 800.0),)
    assert introspect.propose(_snapshot(running), {}, POLICY) == ()
    only_two = _state(configs=(types.Config("ddp", 2, 520.0),))
    assert introspect.propose(_snapshot(running), {"ns/a": only_two}, POLICY) == ()


def test_restart_cost_is_smoothed_over_measurements() -> None:
    assert introspect.update_restart_cost(None, 40.0) == 40.0
    assert introspect.update_restart_cost(40.0, 20.0) == pytest.approx(30.0)


def test_a_grow_pays_for_the_device_seconds_it_takes_from_jobs_that_may_arrive() -> None:
    nodes = (types.Node("a", 8),)
    priced = introspect.Policy(min_gain=2.0, min_interval_seconds=300.0,
                               default_restart_seconds=60.0, grow_price=16.0,
                               grow_load_exponent=0.0)
    # Barely scaling: 2 devices save 20% of its time for 60% more device-seconds.
    barely = _state(configs=(types.Config("single", 1, 1000.0), types.Config("ddp", 2, 800.0)))
    running = (types.Running("ns/a", "a", 1, "single", 3000.0),)
    assert introspect.propose(_snapshot(running, nodes=nodes), {"ns/a": barely}, POLICY)
    assert introspect.propose(_snapshot(running, nodes=nodes), {"ns/a": barely}, priced) == ()
    # Scaling well: 4 devices cut its 3000 s to 840 s for 12% more device-seconds (4 x 840 -
    # 3000 = 360, charged 16 / 8 s each), so it grows, its gain net of that charge.
    (move,) = introspect.propose(_snapshot(running, nodes=nodes), {"ns/a": _state()}, priced)
    assert (move.kind, move.gpus) == ("grow", 4)
    assert move.gain_seconds == pytest.approx(3000 - 840 - 2 * 360 - 60)


def test_a_grow_is_cheap_in_an_idle_pool_and_dear_in_a_busy_one() -> None:
    nodes = (types.Node("a", 8),)
    policy = introspect.Policy(min_gain=2.0, min_interval_seconds=300.0,
                               default_restart_seconds=60.0, grow_price=16.0)
    barely = _state(configs=(types.Config("single", 1, 1000.0), types.Config("ddp", 2, 800.0)))
    alone = (types.Running("ns/a", "a", 1, "single", 3000.0),)
    # 1 of 8 devices busy: each extra device-second costs 16 / 8 x (1/8)^2 s; the grow saves
    # 600 s for 2 x 2400 - 3000 = 1800 more device-seconds.
    (move,) = introspect.propose(_snapshot(alone, nodes=nodes), {"ns/a": barely}, policy)
    assert (move.kind, move.gpus) == ("grow", 2)
    assert move.gain_seconds == pytest.approx(600 - 2 / 64 * 1800 - 60)
    # 6 of 8 busy: (6/8)^2 of the full price, 2025 s for those 1800 device-seconds.
    busy = (*alone, types.Running("ns/b", "a", 5, "ddp", 3000.0))
    assert introspect.propose(_snapshot(busy, nodes=nodes), {"ns/a": barely}, policy) == ()
    # A queued job waiting for the whole node counts as busy too: the pool is full.
    whole = (types.JobRequest("ns/q", (types.Config("ddp", 8, 100.0),), arrival=900.0),)
    assert introspect.propose(_snapshot(alone, nodes=nodes, queued=whole), {"ns/a": barely},
                              policy) == ()


def test_a_long_job_shrinks_so_a_much_shorter_waiting_job_starts() -> None:
    # A long job scaling well on 2 devices (1000 s left; 1 device about doubles that) and a
    # 60-second job that would wait 400 s for another job's device: in plain seconds the
    # shrink loses (it costs the long job more than the short one waits), but a second of
    # wait slows the short job far more than a second of delay slows the long one.
    running = (types.Running("ns/long", "a", 2, "ddp", 1000.0),
               types.Running("ns/other", "a", 1, "single", 400.0))
    queued = (types.JobRequest("ns/short", (types.Config("single", 1, 60.0),), arrival=1000.0),)
    long_job = _state(configs=(types.Config("single", 1, 20000.0),
                               types.Config("ddp", 2, 10400.0)), restart_seconds=10.0)
    plain = introspect.Policy(min_gain=2.0, min_interval_seconds=300.0,
                              default_restart_seconds=60.0, short_job_weight=1.0)
    snapshot = _snapshot(running, queued=queued, nodes=(types.Node("a", 3),))
    assert introspect.propose(snapshot, {"ns/long": long_job}, plain) == ()
    (move,) = introspect.propose(snapshot, {"ns/long": long_job}, introspect.Policy(
        min_gain=2.0, min_interval_seconds=300.0, default_restart_seconds=60.0))
    assert (move.kind, move.gpus, move.helped) == ("shrink", 1, ("ns/short",))
    # weight min(30, 10400 / 60) = 30: 30 x (400 - 10) s of wait against its 923 s
    assert move.gain_seconds == pytest.approx(30 * (400 - 10) - (1000 * 20000 / 10400 - 1000)
                                              - 10)


def test_a_job_that_keeps_waiting_on_an_overrunning_job_gets_a_shrink() -> None:
    # Node a: a grown job (2 devices, 1000 s left). Node b: a job past its estimate, seen as
    # 5 s from its end at every call. The queued 60-second job fits nowhere now.
    nodes = (types.Node("a", 2), types.Node("b", 1))
    running = (types.Running("ns/grown", "a", 2, "ddp", 1000.0),
               types.Running("ns/overrun", "b", 1, "single", 5.0))

    def queued(arrival: float) -> tuple[types.JobRequest, ...]:
        return (types.JobRequest("ns/q", (types.Config("single", 1, 60.0),),
                                 arrival=arrival),)
    states = {"ns/grown": _state(restart_seconds=10.0)}
    # Just arrived: the estimates promise it a device in 5 s, not worth a restart.
    assert introspect.propose(_snapshot(running, nodes=nodes, queued=queued(1000.0)), states,
                              POLICY) == ()
    # Waited 900 s while that promise kept slipping: it is expected to wait as long again.
    (move,) = introspect.propose(_snapshot(running, nodes=nodes, queued=queued(100.0)), states,
                                 POLICY)
    assert (move.job, move.kind, move.gpus, move.helped) == ("ns/grown", "shrink", 1,
                                                             ("ns/q",))


def test_policy_rejects_a_gain_ratio_below_one() -> None:
    with pytest.raises(ValueError, match="min_gain"):
        introspect.Policy(min_gain=0.5)
    with pytest.raises(ValueError, match="short_job_weight"):
        introspect.Policy(short_job_weight=0.5)
    with pytest.raises(ValueError, match="grow_price"):
        introspect.Policy(grow_price=-1.0)
    with pytest.raises(ValueError, match="grow_load_exponent"):
        introspect.Policy(grow_load_exponent=-1.0)
