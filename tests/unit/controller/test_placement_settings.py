"""Tests for the operator's placement flags: objective, namespace GPU quotas and priority
weights reach the planner's settings."""

from __future__ import annotations

import pytest

from kiln.controller import main, settings
from kiln.placement import types


def _options(*argv: str) -> settings.Options:
    return main.options_from_args(main.build_parser().parse_args(list(argv)))


def test_objective_quotas_and_priority_weights_reach_the_planner() -> None:
    options = _options("--placement-objective", "completion-time",
                       "--namespace-gpu-quota", "team-a=8", "--namespace-gpu-quota", "team-b=2",
                       "--priority-weight", "high=4", "--priority-weight", "low=0.5")
    planner = settings.placement_settings(options)
    assert planner.objective == "completion-time"
    assert planner.namespace_gpu_quota == (("team-a", 8), ("team-b", 2))
    assert settings.priority_weights(options) == {"high": 4.0, "low": 0.5}
    defaults = settings.placement_settings(_options())
    assert defaults.objective == "auto" and defaults.namespace_gpu_quota == ()


@pytest.mark.parametrize(("argv", "message"), [
    (("--namespace-gpu-quota", "team-a"), "--namespace-gpu-quota: 'team-a': expected name=value"),
    (("--namespace-gpu-quota", "team-a=0"), "--namespace-gpu-quota: 'team-a=0': expected"),
    (("--namespace-gpu-quota", "team-a=inf"), "positive int value, e.g. team-a=8"),
    (("--priority-weight", "high=x"), "--priority-weight: 'high=x': expected name=value"),
    (("--priority-weight", "high=nan"), "positive float value, e.g. high-priority=4"),
])
def test_bad_entries_are_refused_by_the_parser_naming_the_flag_and_the_form(
        argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _options(*argv)
    assert message in capsys.readouterr().err


def test_a_name_given_twice_is_refused() -> None:
    options = _options("--namespace-gpu-quota", "a=1", "--namespace-gpu-quota", "a=2")
    with pytest.raises(ValueError, match="--namespace-gpu-quota: 'a' is given twice"):
        settings.placement_settings(options)


def test_an_unknown_objective_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    with pytest.raises(SystemExit):
        _options("--placement-objective", "fastest")
    assert "invalid choice: 'fastest'" in capsys.readouterr().err
    assert "completion-time" in types.OBJECTIVES
