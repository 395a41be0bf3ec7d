"""The handlers' error surfacing: unexpected errors in admission are retried a bounded number
of times, then the job is given up on; other handlers keep kopf's retries."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import kopf
import pytest

from kiln import api
from kiln.controller import gates, handlers, metrics, status
from kiln.controller import settings as operator_settings

BODY = {"apiVersion": api.API_VERSION, "kind": api.KIND,
        "metadata": {"name": "poison", "namespace": "team-a", "uid": "u-1"}}


class _Jobs:
    def __init__(self) -> None:
        self.events: list[status.Event] = []

    async def post_event(self, body: dict[str, Any], event: status.Event) -> None:
        self.events.append(event)


def _memo() -> Any:
    deps = types.SimpleNamespace(metrics=metrics.OperatorMetrics(), jobs=_Jobs())
    return types.SimpleNamespace(operator=types.SimpleNamespace(deps=deps))


async def _broken(**_: Any) -> None:
    raise KeyError("graph node 'blocks.0'")


def test_admission_retries_an_unexpected_error_briefly_then_gives_up_on_the_job() -> None:
    given_up: list[tuple[str, int]] = []

    async def give_up(deps: Any, body: dict[str, Any], exc: Exception, attempts: int) -> None:
        given_up.append((f"{type(exc).__name__}: {exc}", attempts))

    memo = _memo()
    admit = handlers._surfaced("admit", _broken, give_up=give_up)
    delays = []
    for retry in range(handlers.UNEXPECTED_ATTEMPTS - 1):
        with pytest.raises(kopf.TemporaryError) as raised:
            asyncio.run(admit(body=BODY, retry=retry, memo=memo))
        delays.append(raised.value.delay)
    assert asyncio.run(admit(body=BODY, retry=handlers.UNEXPECTED_ATTEMPTS - 1, memo=memo)) is None
    assert given_up == [("KeyError: \"graph node 'blocks.0'\"", handlers.UNEXPECTED_ATTEMPTS)]
    assert delays == [2.0, 4.0]
    messages = [e.message for e in memo.operator.deps.jobs.events]
    assert len(messages) == 2 and "it is retried (attempt 1 of 3)" in messages[0]


def test_a_handler_without_give_up_leaves_unexpected_errors_to_kopf() -> None:
    memo = _memo()
    with pytest.raises(KeyError):
        asyncio.run(handlers._surfaced("pods", _broken)(body=BODY, retry=7, memo=memo))
    assert len(memo.operator.deps.jobs.events) == 1


@pytest.mark.parametrize("finalizer", [False, True])
def test_the_finalizer_is_there_only_when_asked_for(finalizer: bool) -> None:
    """kopf adds its finalizer only for a resource with a (non-optional) delete handler."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, operator_settings.Options(finalizer=finalizer), gates.Open())
    deletion = [h for h in registry._changing.get_all_handlers()
                if h.id == "cleanup-job" and h.requires_finalizer]
    assert bool(deletion) == finalizer
    watching = [h for h in registry._watching.get_all_handlers() if h.id == "cleanup-job"]
    assert bool(watching) != finalizer  # without it, the DELETED event forgets the job
