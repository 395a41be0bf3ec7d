"""kiln.contract: the trainer's command line, environment, events and termination message."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import sys
from pathlib import Path

import pytest

from kiln import api, contract

ROOT = Path(__file__).resolve().parents[2]

RESULT = contract.Result(
    metric_name="validation_accuracy", metric=0.97, validation_accuracy=0.97,
    validation_loss=0.1, wall_seconds=12.5, time_to_target_seconds=8.0, target_reached=True,
    epochs_run=3, steps=60, samples_per_second=900.0, zoo_model="small_cnn-0123abcd",
    resumed_from_epoch=0,
)
PROGRESS = contract.Progress(
    epoch=1, epochs=3, step=20, steps_per_epoch=20, train_loss=float("nan"),
    validation_accuracy=None, validation_loss=None, samples_per_second=10.0, eta_seconds=None,
    elapsed_seconds=1.0)


def test_the_trainer_runs_under_torchrun_for_several_processes_and_python_for_one() -> None:
    argv = ["--job", "job.yaml", "--parallelism", "ddp"]
    assert contract.trainer_command(4, argv, python="py") == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        "-m", "kiln_trainer", *argv]
    assert contract.trainer_command(1, argv) == [sys.executable, "-m", "kiln_trainer", *argv]
    with pytest.raises(ValueError, match="processes: 0"):
        contract.trainer_command(0, argv)


def test_torchrun_runs_any_module_the_same_way() -> None:
    assert contract.torchrun_command(2, "kiln.placement.profile", ["--worker", "s", "o"],
                                     python="py") == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "kiln.placement.profile", "--worker", "s", "o"]


def test_flags_win_over_the_environment_which_wins_over_defaults() -> None:
    parse = contract.parse_trainer_args
    assert parse([], {}) == contract.TrainerArgs()
    env = {"KILN_JOB_FILE": "env.yaml", "KILN_ZOO": "s3://z", "KILN_METRICS_PORT": "9090",
           "KILN_CHECKPOINTS": "/c", "KILN_PARALLELISM": "fsdp",
           "KILN_WARM_START": '{"parent": null}'}
    assert parse([], env) == contract.TrainerArgs(
        job_file="env.yaml", zoo="s3://z", metrics_port=9090, checkpoint_dir="/c",
        parallelism="fsdp", warm_start='{"parent": null}')
    assert parse(["--job", "j.yaml", "--parallelism", "ddp"], env).parallelism == "ddp"
    assert parse(["--no-register", "--no-resume"], {}) == contract.TrainerArgs(
        register=False, resume=False)


def test_flags_round_trip_through_the_parser() -> None:
    args = contract.TrainerArgs(job_file="j.yaml", zoo="zoo", metrics_port=9000,
                                checkpoint_dir="c", register=False, resume=False,
                                parallelism="ddp", warm_start="{}")
    assert contract.parse_trainer_args(args.to_argv(), {}) == args
    assert contract.TrainerArgs(job_file="j.yaml").to_argv() == ["--job", "j.yaml"]


def test_a_bad_parallelism_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        contract.parse_trainer_args(["--parallelism", "tensor"], {})
    assert "invalid choice: 'tensor'" in capsys.readouterr().err


@pytest.mark.parametrize("event", [
    pytest.param(PROGRESS, id="progress"),
    pytest.param(contract.Info("resumed at epoch 2"), id="info"),
    pytest.param(contract.Info("warm start from m-1", warm_start_decision=api.WarmStartDecision(
        parent="m-1", similarity=0.73, outcome=api.WarmStartOutcome.WARM)), id="info-warm"),
    pytest.param(RESULT, id="result"),
    pytest.param(contract.Failure("spec.dataset.path: no such file"), id="failure"),
])
def test_every_event_is_one_strict_json_line_that_reads_back(event: contract.Event) -> None:
    line = contract.to_line(event)
    assert "\n" not in line and json.loads(line)["event"] == event.KIND
    back = contract.from_line(line + "\n")
    assert back == (dataclasses.replace(event, train_loss=None)
                    if isinstance(event, contract.Progress) else event)


def test_non_finite_numbers_are_written_as_null() -> None:
    assert json.loads(contract.to_line(PROGRESS))["train_loss"] is None


@pytest.mark.parametrize("line", [
    pytest.param("", id="empty"), pytest.param("epoch 1 done", id="text"),
    pytest.param("{not json", id="broken"), pytest.param("[1, 2]", id="list"),
    pytest.param('{"event": "future-kind", "x": 1}', id="unknown-kind"),
    pytest.param('{"no": "kind"}', id="no-kind"),
])
def test_lines_that_are_not_events_read_as_none(line: str) -> None:
    assert contract.from_line(line) is None


def test_a_known_event_with_missing_fields_is_an_error_naming_them() -> None:
    with pytest.raises(ValueError, match="result event without metric_name, metric"):
        contract.from_line('{"event": "result", "steps": 3}')


@pytest.mark.parametrize("field,value,expected", [
    pytest.param("parameters", "12", "valid integer; got str '12'", id="number-as-string"),
    pytest.param("batch_size", 32.5, "valid integer; got float 32.5", id="fraction-as-count"),
    pytest.param("step_seconds", True, "valid number; got bool True", id="bool-as-number"),
    pytest.param("device", 0, "valid string; got int 0", id="number-as-text"),
    pytest.param("warm_start_decision", [],
                 "valid dictionary or instance of WarmStartDecision; got list []", id="list"),
])
def test_an_event_with_a_field_of_the_wrong_type_is_an_error_naming_it(
        field: str, value: object, expected: str) -> None:
    profile = {"event": "profile", "parameters": 12, "flops_per_sample": None, "graph_nodes": 3,
               "untraceable": None, "device": "cpu", "batch_size": 32, "step_seconds": 0.1,
               "step_status": "ok"}
    assert contract.from_line(json.dumps(profile)) is not None
    line = json.dumps({**profile, field: value})
    with pytest.raises(ValueError, match=re.escape(
            f"profile event field '{field}': input should be a {expected}")):
        contract.from_line(line)
    assert contract.read_termination_message(line) is None  # not a report to act on


@pytest.mark.parametrize(("decision", "expected"), [
    pytest.param({"outcome": "warm", "parent": "p-1", "similarity": "0.8"},
                 "'warm_start_decision.similarity': input should be a valid number; got str",
                 id="number-as-string"),
    pytest.param({"outcome": "lukewarm"},
                 "'warm_start_decision.outcome': input should be 'warm', 'pinned'",
                 id="unknown-outcome"),
])
def test_a_malformed_warm_start_decision_is_an_error_naming_its_field(
        decision: dict[str, object], expected: str) -> None:
    line = contract.to_line(dataclasses.replace(RESULT, warm_start_decision=DECISION))
    good = json.loads(line)
    assert contract.from_line(line) == dataclasses.replace(RESULT, warm_start_decision=DECISION)
    with pytest.raises(ValueError, match=re.escape(f"result event field {expected}")):
        contract.from_line(json.dumps({**good, "warm_start_decision": decision}))


def test_the_termination_message_stays_under_the_kubernetes_cap() -> None:
    failure = contract.termination_message(contract.Failure("x" * 10_000))
    assert len(failure) <= contract.TERMINATION_MESSAGE_MAX_BYTES < 4096
    assert isinstance(contract.read_termination_message(failure.decode()), contract.Failure)
    history = [{"kind": "froze", "modules": [f"features.{i}" for i in range(40)], "step": i,
                "reason": "x" * 200} for i in range(8)]
    result = dataclasses.replace(RESULT, freezing={"events": history, "saved_seconds": 3.5})
    data = contract.termination_message(result)
    assert len(data) <= contract.TERMINATION_MESSAGE_MAX_BYTES
    back = contract.read_termination_message(data.decode())
    assert back == dataclasses.replace(RESULT, freezing={"saved_seconds": 3.5})


DECISION = api.WarmStartDecision(
    parent="small_cnn-89abcdef", similarity=0.8, parent_metric=0.9, matched_tensors=6,
    total_tensors=8, outcome=api.WarmStartOutcome.WARM,
    reason="warm start from small_cnn-89abcdef (similarity 0.80)")
# Characters whose JSON escapes are long: accents (6 bytes), emoji (12), quotes, controls.
AWKWARD = "é✓🙂\"\\\n\t\u2028x "


def _read_back(event: contract.Result | contract.Failure | contract.Profile) -> contract.Event:
    data = contract.termination_message(event)
    assert len(data) <= contract.TERMINATION_MESSAGE_MAX_BYTES
    back = contract.read_termination_message(data.decode("utf-8"))
    assert back is not None, data[-200:]
    return back


def _assert_key_fields_kept(back: contract.Event) -> None:
    assert isinstance(back, contract.Result)
    assert (back.zoo_model, back.metric_name, back.metric, back.target_reached) == (
        RESULT.zoo_model, RESULT.metric_name, RESULT.metric, RESULT.target_reached)


@pytest.mark.parametrize("result", [
    pytest.param(dataclasses.replace(RESULT, freezing={"events": [
        {"kind": "froze", "modules": [f"features.{i}" for i in range(40)], "step": step,
         "reason": "é" * 200} for step in range(500)], "saved_seconds": 3.5}),
        id="huge-freezing-history"),
    pytest.param(dataclasses.replace(RESULT, freezing={
        "modules": {f"block{i}": "🙂" * 50 for i in range(200)}}), id="huge-freezing-summary"),
    pytest.param(dataclasses.replace(RESULT, warm_start=AWKWARD * 2000), id="huge-warm-start"),
    pytest.param(dataclasses.replace(RESULT, warm_start_decision=DECISION.model_copy(
        update={"reason": AWKWARD * 2000})), id="huge-decision-reason"),
    pytest.param(dataclasses.replace(RESULT, warm_start_decision=DECISION.model_copy(
        update={"alternatives": ["x" * 100] * 100})), id="huge-decision"),
    pytest.param(dataclasses.replace(RESULT, parent="p" * 5000), id="huge-parent"),
])
def test_a_result_too_long_still_parses_and_keeps_its_zoo_model_and_metric(
    result: contract.Result,
) -> None:
    _assert_key_fields_kept(_read_back(result))


def test_a_too_long_result_drops_the_freezing_history_before_the_warm_start_sentence() -> None:
    result = dataclasses.replace(
        RESULT, warm_start="warm start from small_cnn-89abcdef", warm_start_decision=DECISION,
        freezing={"events": [{"step": step, "reason": "x" * 100} for step in range(100)],
                  "frozen_modules": 2})
    back = _read_back(result)
    assert back == dataclasses.replace(result, freezing={"frozen_modules": 2})


def test_long_reasons_are_shortened_keeping_the_decision_s_outcome_and_parent() -> None:
    result = dataclasses.replace(RESULT, warm_start="é" * 3000, warm_start_decision=(
        DECISION.model_copy(update={"reason": "🙂" * 3000})))
    back = _read_back(result)
    assert isinstance(back, contract.Result) and back.warm_start_decision is not None
    assert (back.warm_start_decision.parent, back.warm_start_decision.outcome) == (
        DECISION.parent, api.WarmStartOutcome.WARM)
    for text in (back.warm_start, back.warm_start_decision.reason):
        assert text == "" or (text.endswith("...") and set(text[:-3]) <= {"é", "🙂"})
    assert back.warm_start or back.warm_start_decision.reason  # the room left is used


@pytest.mark.parametrize("seed", range(20))
def test_any_result_mixing_long_fields_reads_back_with_its_key_fields(seed: int) -> None:
    rng = random.Random(seed)

    def text() -> str:
        return "".join(rng.choice(AWKWARD) for _ in range(rng.choice([0, 10, 700, 5000])))

    result = dataclasses.replace(
        RESULT, warm_start=text(), parent=rng.choice([None, text()]),
        freezing=rng.choice([None, {"events": [text() for _ in range(rng.randint(0, 5))],
                                    "summary": text()}]),
        warm_start_decision=rng.choice([None, DECISION.model_copy(update={"reason": text()})]))
    _assert_key_fields_kept(_read_back(result))


@pytest.mark.parametrize("message", [
    pytest.param("x" * 10_000, id="ascii"), pytest.param("é" * 10_000, id="accents"),
    pytest.param("🙂" * 10_000, id="emoji"), pytest.param(AWKWARD * 3000, id="escapes"),
])
def test_a_long_failure_message_is_cut_at_a_character_and_still_parses(message: str) -> None:
    back = _read_back(contract.Failure(message))
    assert isinstance(back, contract.Failure)
    assert back.message.endswith("...") and message.startswith(back.message[:-3])
    assert len(back.message) > 100  # the cap's room is used, not a fixed character count


def test_a_profile_with_long_texts_still_parses_and_keeps_its_numbers_and_decision() -> None:
    profile = contract.Profile(
        parameters=1234, flops_per_sample=5e6, graph_nodes=None, untraceable="ü" * 5000,
        device="cpu", batch_size=64, step_seconds=None, step_status="failed",
        step_detail="🙂" * 5000,
        warm_start_decision=DECISION.model_copy(update={"reason": "é" * 5000}))
    back = _read_back(profile)
    assert isinstance(back, contract.Profile) and back.warm_start_decision is not None
    assert (back.parameters, back.step_status, back.warm_start_decision.outcome) == (
        1234, "failed", api.WarmStartOutcome.WARM)


@pytest.mark.parametrize("text", [
    pytest.param("", id="empty"), pytest.param('{"event": "result", "metric"', id="cut-off"),
    pytest.param("Traceback ...\nRuntimeError: boom", id="log-tail"),
    pytest.param(contract.to_line(contract.Info("hello")), id="not-an-ending"),
])
def test_a_termination_message_without_result_or_failure_reads_as_none(text: str) -> None:
    assert contract.read_termination_message(text) is None


def test_every_kiln_environment_variable_in_the_code_is_in_the_contract() -> None:
    known = {e.value for e in contract.Env}
    used, constants = set(), set()  # constants: Python names such as KILN_ROOT, not variables
    for package in ("operator/kiln", "trainer_image/kiln_trainer"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            used |= set(re.findall(r"\bKILN_[A-Z_]*[A-Z]\b", text))
            constants |= set(re.findall(r"^(KILN_[A-Z_]*[A-Z]) =", text, re.MULTILINE))
    assert used - constants - known == set()
