"""The whole-run check of the operator's API calls (`kubesim.usage`) sees every xdist worker's.

Each inner pytest run has one e2e test per call, each recording it as the e2e fixtures record
the operator's; over two workers neither records every rule, so only their union can pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.controller import rbac

TESTS = Path(__file__).resolve().parents[1]
UNUSED = min(rbac.triples())
E2E_TESTS = """
import pytest
from kubesim import usage

CALLS = {calls!r}


@pytest.mark.parametrize(("group", "resource", "verb"), CALLS)
def test_the_operator_calls(request, group, resource, verb):
    usage.recorded(request.config).add(usage.ApiCall(verb, group, resource, False))
"""


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
         calls: list[tuple[str, str, str]], *args: str) -> pytest.RunResult:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # kubesim
    (pytester.path / "e2e").mkdir(exist_ok=True)
    (pytester.path / "e2e" / "test_calls.py").write_text(E2E_TESTS.format(calls=calls))
    return pytester.runpytest_subprocess("-p", "kubesim.usage", *args)


@pytest.mark.parametrize("workers", [["-n", "2"], ["-p", "no:xdist"]], ids=["xdist", "serial"])
def test_a_run_whose_calls_use_every_rule_passes(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]) -> None:
    result = _run(pytester, monkeypatch, sorted(rbac.triples()), *workers)
    result.assert_outcomes(passed=len(rbac.triples()))
    assert result.ret == pytest.ExitCode.OK
    assert "operator RBAC usage" not in result.stdout.str()


@pytest.mark.parametrize("workers", [["-n", "2"], ["-p", "no:xdist"]], ids=["xdist", "serial"])
def test_a_rule_no_e2e_test_used_fails_the_run_naming_it(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]) -> None:
    result = _run(pytester, monkeypatch, sorted(rbac.triples() - {UNUSED}), *workers)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*operator RBAC usage*",
                                 f"*declares calls no e2e test made*{UNUSED!r}*"])


def test_a_call_no_rule_declares_fails_even_a_partial_run_which_skips_the_unused_check(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    undeclared = ("", "configmaps", "get")
    result = _run(pytester, monkeypatch, [*sorted(rbac.triples() - {UNUSED}), undeclared],
                  "-n", "2", "-k", "not watch")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    output = result.stdout.str()
    assert f"does not declare (declare them, or stop making them): [{undeclared!r}]" in output
    assert "no e2e test made" not in output  # -k left tests out: no verdict on unused rules


def test_a_run_of_some_e2e_files_passes_without_a_verdict_on_unused_rules(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    (pytester.mkdir("e2e") / "test_other.py").write_text("def test_other():\n    pass\n")
    result = _run(pytester, monkeypatch, sorted(rbac.triples() - {UNUSED}), "-n", "2",
                  "e2e/test_calls.py")
    assert result.ret == pytest.ExitCode.OK
    assert "operator RBAC usage" not in result.stdout.str()
