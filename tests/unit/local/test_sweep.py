"""`kiln sweep` without training: the state a rerun resumes, the conditions, the ranking, and
`kiln sweep show` / `kiln plot --sweep` on a sweep's document (a local state or a cluster's)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import clirun
import pytest
import yaml
from rich.console import Console

from kiln import api, cli, sweep
from kiln.local import output
from kiln.local import sweep as local_sweep

_Trial = api.sweep.Trial
_State = api.sweep.TrialState


def _doc(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep",
            "metadata": {"name": "search"},
            "spec": {"template": {"model": {"architecture": "small_cnn",
                                            "inputShape": [1, 8, 8]},
                                  "training": {"epochs": 4}},
                     "parameters": [{"path": "training.optimizer.lr",
                                     "float": {"min": 0.001, "max": 0.1, "log": True}},
                                    {"path": "model.args.width", "categorical": [8, 16]}],
                     **spec}}


# A sweep as `kubectl get tsw search -o yaml` prints it: server metadata and a status.
CLUSTER_SWEEP = {
    **_doc(earlyStopping={"name": "asha", "minEpochs": 1}),
    "metadata": {"name": "search", "namespace": "team-a", "uid": "0d5c4c1e-1",
                 "resourceVersion": "4711", "generation": 1,
                 "creationTimestamp": "2026-01-01T00:00:00Z",
                 "managedFields": [{"manager": "kubectl", "operation": "Update"}]},
    "status": {
        "phase": "Succeeded", "startTime": "2026-01-01T00:00:01Z",
        "completionTime": "2026-01-01T00:10:00Z",
        "trials": {"total": 3, "succeeded": 2, "pruned": 1},
        "best": {"trial": "search-t2", "index": 2, "metric": 0.961,
                 "params": {"training.optimizer.lr": 0.02, "model.args.width": 16},
                 "zooModel": "small_cnn-aa11bb22"},
        "conditions": [{"type": "Created", "status": "True", "reason": "Validated"},
                       {"type": "Succeeded", "status": "True", "reason": "MaxTrialsReached",
                        "message": "3 trials ended"}],
        "history": [
            {"index": 0, "name": "search-t0", "state": "Succeeded", "metric": 0.93,
             "params": {"training.optimizer.lr": 0.005, "model.args.width": 8},
             "evaluations": [[1, 0.8, 10.0], [4, 0.93, 40.0]], "zooModel": "small_cnn-00aa00aa"},
            {"index": 1, "name": "search-t1", "state": "Pruned", "metric": 0.11,
             "params": {"training.optimizer.lr": 0.0011, "model.args.width": 8},
             "evaluations": [[1, 0.11, 50.0]],
             "prunedAt": {"epoch": 1, "value": 0.11, "against": "rung 0: needs >= 0.8"}},
            {"index": 2, "name": "search-t2", "state": "Succeeded", "metric": 0.961,
             "params": {"training.optimizer.lr": 0.02, "model.args.width": 16},
             "evaluations": [[1, 0.85, 60.0], [4, 0.961, 90.0]],
             "parent": "small_cnn-00aa00aa", "zooModel": "small_cnn-aa11bb22"}]}}


def test_a_new_sweep_gets_a_uid_and_a_rerun_keeps_the_recorded_status(tmp_path: Path) -> None:
    state = local_sweep.state_path(tmp_path, "search")
    fresh = local_sweep.resumed(api.sweep.parse_sweep(_doc()), state)
    assert fresh.metadata.uid and fresh.status is None
    trial = _Trial(index=0, name="search-t0", state=_State.RUNNING,
                   params={"training.optimizer.lr": 0.01, "model.args.width": 8})
    recorded = fresh.model_copy(update={"status": api.sweep.TrainingSweepStatus(
        history=[trial])})
    local_sweep.write_state(state, recorded)
    assert [p.name for p in tmp_path.iterdir()] == [state.name]  # no temporary file left
    # raising maxTrials continues the same search: same uid (its trials' zoo ids), same trials
    again = local_sweep.resumed(api.sweep.parse_sweep(_doc(maxTrials=30)), state)
    assert again.metadata.uid == fresh.metadata.uid and again.spec.max_trials == 30
    assert again.status is not None and again.status.history == [trial]


def test_a_rerun_that_changes_the_search_is_refused_naming_the_fields(tmp_path: Path) -> None:
    state = local_sweep.state_path(tmp_path, "search")
    local_sweep.write_state(state, local_sweep.resumed(api.sweep.parse_sweep(_doc()), state))
    changed = _doc(warmStart="independent")
    changed["spec"]["parameters"][1]["categorical"] = [8, 32]
    with pytest.raises(local_sweep.SweepError) as caught:
        local_sweep.resumed(api.sweep.parse_sweep(changed), state)
    message = str(caught.value)
    assert "spec.parameters, spec.warmStart differ from the sweep recorded in" in message
    assert "new metadata.name" in message and "delete that file" in message


def test_a_damaged_or_hand_edited_state_is_refused_naming_the_file_and_the_fix(
        tmp_path: Path) -> None:
    state = local_sweep.state_path(tmp_path, "search")
    state.write_text('{"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSw', encoding="utf-8")
    given = api.sweep.parse_sweep(_doc())
    with pytest.raises(local_sweep.SweepError) as caught:
        local_sweep.resumed(given, state)
    assert f"sweep search: its recorded state {state} cannot be read" in str(caught.value)
    assert "delete that file to start the sweep over" in str(caught.value)
    params = {"training.optimizer.lr": 0.01, "model.args.width": 8}
    for history, why in (
            ([_Trial(index=1, name="search-t1", state=_State.RUNNING, params=params)],
             "index 1, name search-t1"),
            ([_Trial(index=0, name="search-t0", state=_State.RUNNING,
                     params={**params, "model.args.width": 64})],
             "recorded model.args.width=64 is not among the parameter's values")):
        local_sweep.write_state(state, given.model_copy(update={
            "status": api.sweep.TrainingSweepStatus(history=history)}))
        with pytest.raises(local_sweep.SweepError) as caught:
            local_sweep.resumed(given, state)
        assert "status.history[0] is not trial 0 of this sweep" in str(caught.value)
        assert why in str(caught.value) and "delete that file" in str(caught.value)


@pytest.mark.process  # importing the trainer's stack runs ldconfig (ctypes finding a library)
def test_a_state_renamed_by_hand_is_refused_before_any_trial_starts(tmp_path: Path) -> None:
    (tmp_path / "tsw.yaml").write_text(yaml.safe_dump(_doc()), encoding="utf-8")
    runs = tmp_path / ".kiln" / "runs"
    runs.mkdir(parents=True)
    other = api.sweep.parse_sweep({**_doc(), "metadata": {"name": "other"}})
    local_sweep.write_state(local_sweep.state_path(runs, "search"), other)
    done = clirun.kiln("sweep", "run", "tsw.yaml", "--zoo", "zoo", cwd=tmp_path)
    assert done.returncode == cli.EXIT_USAGE, done.stderr
    assert "sweep search: its recorded state" in done.stderr
    assert "is sweep other's (metadata.name); delete that file" in done.stderr
    assert not list(runs.glob("*-t*"))  # no trial was started


def test_a_trials_evaluation_without_an_epoch_and_a_value_is_refused_by_name() -> None:
    doc = {**CLUSTER_SWEEP, "status": {"history": [
        {"index": 0, "name": "search-t0", "state": "Running", "evaluations": [[], [1]]}]}}
    with pytest.raises(api.InvalidSpec) as caught:
        api.sweep.parse_sweep(doc)
    assert [p.split(":")[0] for p in caught.value.problems] == [
        "status.history[0].evaluations[0]", "status.history[0].evaluations[1]"]


def test_conditions_keep_their_transition_time_while_their_status_holds() -> None:
    counts = api.sweep.TrialCounts(total=1, running=1)
    running = sweep.Standing(counts, None, api.sweep.SweepPhase.RUNNING, "TrialsRunning",
                             "1 running", 1)
    first = local_sweep.conditions([], running, "2026-01-01T00:00:00Z")
    assert [(c.type.value, c.status) for c in first] == [("Created", "True"), ("Running", "True")]
    later = local_sweep.conditions(first, running, "2026-01-01T00:05:00Z")
    assert [c.last_transition_time for c in later] == ["2026-01-01T00:00:00Z"] * 2
    done = sweep.Standing(counts, None, api.sweep.SweepPhase.SUCCEEDED, "MaxTrialsReached",
                          "2 trials ended", 0)
    ended = local_sweep.conditions(later, done, "2026-01-01T00:09:00Z")
    assert [(c.type.value, c.status, c.last_transition_time) for c in ended] == [
        ("Created", "True", "2026-01-01T00:00:00Z"), ("Running", "False", "2026-01-01T00:09:00Z"),
        ("Succeeded", "True", "2026-01-01T00:09:00Z")]
    assert ended[2].reason == "MaxTrialsReached"


@pytest.mark.parametrize(("metric", "order"), [("validation_accuracy", [1, 2, 0, 3]),
                                                ("validation_loss", [0, 2, 1, 3])])
def test_trials_rank_best_first_by_metric_else_last_evaluation(metric: str,
                                                               order: list[int]) -> None:
    spec = api.sweep.parse_sweep(_doc(objective={"metric": metric})).spec
    trials = [_Trial(index=0, name="t0", state=_State.SUCCEEDED, metric=0.2),
              _Trial(index=1, name="t1", state=_State.SUCCEEDED, metric=0.9),
              _Trial(index=2, name="t2", state=_State.RUNNING, evaluations=[[1, 0.5, 3.0]]),
              _Trial(index=3, name="t3", state=_State.RUNNING)]
    assert [t.index for t in sweep.ranked(spec.objective, trials)] == order


def test_sweep_show_reads_a_clusters_sweep_from_stdin(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(CLUSTER_SWEEP)))
    assert cli.main(["sweep", "show", "-"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("search-t")]
    assert [row[0] for row in rows] == ["search-t2", "search-t0", "search-t1"]  # best first
    t2, _, t1 = (" ".join(row) for row in rows)
    assert "warm: small_cnn-00aa00aa" in t2 and "small_cnn-aa11bb22" in t2
    assert "Pruned" in t1 and "epoch 1 (0.1100): rung 0: needs >= 0.8" in t1
    assert "lr" in out.splitlines()[1] and "width" in out.splitlines()[1]  # short headers
    assert "best: search-t2 (val acc 0.9610): training.optimizer.lr=0.02 model.args.width=16" \
        in out
    assert "best zoo model: small_cnn-aa11bb22" in out
    assert "trials: 3 (2 succeeded, 1 pruned, 0 failed, 0 running)" in out
    assert "phase: Succeeded: 3 trials ended" in out


def test_sweep_show_on_a_narrow_terminal_keeps_a_trial_to_a_line_and_says_where_the_rest_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(CLUSTER_SWEEP)))
    out = io.StringIO()
    monkeypatch.setattr(output, "stdout_console",
                        lambda: Console(file=out, width=80, force_terminal=True))
    assert cli.main(["sweep", "show", "-"]) == cli.EXIT_OK
    lines = out.getvalue().splitlines()
    rows = [line for line in lines if re.match(r"^\W*t[0-9]", line)]
    assert [re.findall(r"t[0-9]", row)[0] for row in rows] == ["t2", "t0", "t1"]  # one line each
    assert "small_cnn-aa11bb22" not in "\n".join(rows)  # no zoo model column
    assert "kiln sweep show search -o yaml" in out.getvalue()


def test_sweep_show_prints_the_document_for_scripts(tmp_path: Path) -> None:
    (tmp_path / "tsw.json").write_text(json.dumps(CLUSTER_SWEEP), encoding="utf-8")
    done = clirun.kiln("sweep", "show", "tsw.json", "-o", "json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["status"]["best"]["zooModel"] == "small_cnn-aa11bb22"
    assert api.sweep.parse_sweep(shown) == api.sweep.parse_sweep(CLUSTER_SWEEP)


def test_sweep_show_of_the_file_a_sweep_was_run_from_shows_its_run_here(tmp_path: Path) -> None:
    spec_only = {k: v for k, v in CLUSTER_SWEEP.items() if k != "status"}
    (tmp_path / "search.yaml").write_text(yaml.safe_dump(spec_only), encoding="utf-8")
    (tmp_path / ".kiln" / "runs").mkdir(parents=True)
    (tmp_path / ".kiln" / "runs" / "search.sweep.json").write_text(
        json.dumps(CLUSTER_SWEEP), encoding="utf-8")
    done = clirun.kiln("sweep", "show", "search.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "search.yaml has no trials; showing sweep search as run here" in done.stderr
    assert "best zoo model: small_cnn-aa11bb22" in done.stdout


def test_sweep_show_names_what_it_could_not_find(tmp_path: Path) -> None:
    done = clirun.kiln("sweep", "show", "nowhere", cwd=tmp_path)
    assert done.returncode == cli.EXIT_USAGE
    assert "nowhere: no such file, and no sweep of that name was run here" in done.stderr
    (tmp_path / "folder").mkdir()
    done = clirun.kiln("sweep", "show", "folder", cwd=tmp_path)
    assert done.returncode == cli.EXIT_USAGE
    assert "folder is a folder; give a TrainingSweep file" in done.stderr, done.stderr
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
         "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]}}}),
        encoding="utf-8")
    wrong = clirun.kiln("sweep", "show", "job.yaml", cwd=tmp_path)
    assert wrong.returncode == cli.EXIT_USAGE
    assert "expected one TrainingSweep document; found: TrainingJob" in wrong.stderr
    (tmp_path / "bad-job.yaml").write_text(yaml.safe_dump(  # no spec.model: invalid too
        {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
         "spec": {}}), encoding="utf-8")
    wrong = clirun.kiln("sweep", "show", "bad-job.yaml", cwd=tmp_path)
    assert wrong.returncode == cli.EXIT_USAGE
    assert ("expected one TrainingSweep document; found an invalid TrainingJob: spec.model"
            in wrong.stderr), wrong.stderr


def test_plot_draws_every_trial_of_a_sweep_pruned_ones_dashed(tmp_path: Path) -> None:
    from kiln.local import plots

    figure = plots.sweep_figure(api.sweep.parse_sweep(CLUSTER_SWEEP))
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()
             if not line.get_label().startswith("_")}
    assert sorted(lines) == ["search-t0 (succeeded)", "search-t1 (pruned)",
                             "search-t2 (succeeded)"]
    assert lines["search-t1 (pruned)"].get_linestyle() == "--"
    assert lines["search-t0 (succeeded)"].get_linestyle() == "-"
    assert lines["search-t2 (succeeded)"].get_linewidth() > lines[
        "search-t0 (succeeded)"].get_linewidth()  # the best
    (tmp_path / "tsw.yaml").write_text(yaml.safe_dump(CLUSTER_SWEEP), encoding="utf-8")
    done = clirun.kiln("plot", "--sweep", "tsw.yaml", "--out", "trials.png", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "trials.png").stat().st_size > 0


def test_plot_of_a_sweep_refuses_an_x_axis_it_does_not_draw(tmp_path: Path) -> None:
    (tmp_path / "tsw.yaml").write_text(yaml.safe_dump(CLUSTER_SWEEP), encoding="utf-8")
    done = clirun.kiln("plot", "--sweep", "tsw.yaml", "--x", "step", "--out", "x.png",
                       cwd=tmp_path)
    assert done.returncode == cli.EXIT_USAGE
    assert "--x step: only RUN curves take another x axis" in done.stderr
    assert not (tmp_path / "x.png").exists()


def test_plot_of_a_sweep_without_evaluations_says_so(tmp_path: Path) -> None:
    (tmp_path / "tsw.yaml").write_text(yaml.safe_dump(_doc()), encoding="utf-8")
    done = clirun.kiln("plot", "--sweep", "tsw.yaml", "--out", "x.png", cwd=tmp_path)
    assert done.returncode == cli.EXIT_USAGE
    assert "sweep search: no trial has evaluated yet" in done.stderr


@pytest.mark.process  # importing the trainer's stack runs ldconfig (ctypes finding a library)
def test_a_second_run_of_a_sweep_here_is_refused_before_any_trial_starts(
        tmp_path: Path) -> None:
    from kiln.local import runner

    (tmp_path / "tsw.yaml").write_text(yaml.safe_dump(_doc()), encoding="utf-8")
    runs = tmp_path / ".kiln" / "runs"
    runs.mkdir(parents=True)
    with runner.lock(runs / "search.sweep.lock", "search", kind="sweep"):
        done = clirun.kiln("sweep", "run", "tsw.yaml", "--zoo", "zoo", cwd=tmp_path)
    assert done.returncode == cli.EXIT_USAGE
    assert "sweep search is already running" in done.stderr
    assert not list(runs.glob("search-t*"))  # no trial was started
