"""Settings in one place: `settings.Options` holds each default once; the slices the pod
builder, the placement loop and the planner take are made from it and declare none."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kiln.controller import main, placement_loop, pods, settings
from kiln.placement import types


@pytest.mark.parametrize("part", [pods.PodSettings, placement_loop.LoopSettings])
def test_a_settings_slice_declares_no_default_of_its_own(part: Any) -> None:
    defaulted = [f.name for f in dataclasses.fields(part)
                 if f.default is not dataclasses.MISSING
                 or f.default_factory is not dataclasses.MISSING]
    assert defaulted == []


def test_the_slices_carry_the_options_defaults() -> None:
    options = settings.Options()
    pod = settings.pod_settings(options)
    # Same name, other meaning: the trainer's port; contexts given as JSON text.
    derived = {"metrics_port", "pod_security_context", "container_security_context"}
    shared = {f.name for f in dataclasses.fields(pods.PodSettings)} & {
        f.name for f in dataclasses.fields(settings.Options)} - derived
    assert {name: getattr(pod, name) for name in shared} == {
        name: getattr(options, name) for name in shared}
    assert pod.zoo_pod_access == "presigned" and pod.presigned_zoo
    assert pod.metrics_port == options.trainer_metrics_port
    assert pod.pod_security_context == json.loads(options.pod_security_context)
    assert pod.container_security_context == json.loads(options.container_security_context)
    loop = main.loop_settings(options)
    assert (loop.gpu_type_label, loop.gpu_resources) == (options.gpu_type_label,
                                                         options.gpu_resources)
    assert loop.interval_seconds == options.placement_interval_seconds


def test_the_operators_planner_differs_from_the_planners_defaults_only_where_it_says() -> None:
    options = settings.Options()
    assert settings.placement_settings(options) == dataclasses.replace(
        types.Settings(), time_limit_seconds=options.placement_time_limit_seconds)
    for field in ("use_milp", "freeze_window_seconds", "objective"):
        assert getattr(options, f"placement_{field}") == getattr(types.Settings(), field)
