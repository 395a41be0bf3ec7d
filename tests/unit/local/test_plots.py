"""`kiln plot` and the run history it reads: `runner.append_history`/`read_history` (restarts keep
the latest stretch), the curve and Gantt figures, and the command writing real PNG files."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import zoofactory
from matplotlib import image
from matplotlib.ticker import MaxNLocator
from rich.console import Console

from kiln import cli, contract
from kiln.local import plots, runner
from kiln.zoo import records, store


def _progress(step: int, *, accuracy: float, evaluated: bool = True,
              frozen: int | None = None) -> contract.Progress:
    return contract.Progress(
        epoch=step // 10 + 1, epochs=3, step=step, steps_per_epoch=10, train_loss=2.0 / step,
        validation_accuracy=accuracy, validation_loss=1.0 - accuracy, samples_per_second=50.0,
        eta_seconds=None, elapsed_seconds=step / 5, frozen_modules=frozen,
        modules=None if frozen is None else 4, evaluated=evaluated)


def _history(path: Path, steps: list[int], *, frozen: int | None = None) -> Path:
    for step in steps:
        runner.append_history(path, _progress(step, accuracy=step / 40, frozen=frozen))
    return path


def test_only_evaluations_are_kept_and_a_restart_keeps_the_latest_stretch(tmp_path: Path) -> None:
    path = tmp_path / "job.metrics.jsonl"
    runner.append_history(path, _progress(5, accuracy=0.1, evaluated=False))  # between evals
    _history(path, [10, 20, 30])
    _history(path, [20, 30])  # resumed from the step-10 checkpoint: 20 and 30 ran again
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 40, "trai')  # a torn last line after a crash
    lines = runner.read_history(path)
    assert [line["step"] for line in lines] == [10, 20, 30]
    assert len(path.read_text(encoding="utf-8").splitlines()) == 6
    first = lines[0]
    assert first["validation_accuracy"] == pytest.approx(0.25)
    assert first["train_loss"] == pytest.approx(0.2) and first["elapsed_seconds"] == 2.0
    assert {"epoch", "validation_loss", "frozen_modules", "time"} <= first.keys()


def test_curves_of_warm_and_cold_runs_side_by_side_with_a_frozen_panel(tmp_path: Path) -> None:
    _history(tmp_path / "warm.metrics.jsonl", [10, 20], frozen=2)
    with pytest.raises(plots.PlotError, match="cold.log: cannot read .*cold.metrics.jsonl"):
        plots.load_runs([tmp_path / "cold.log"])  # a log resolves to its history beside it
    (tmp_path / "cold.metrics.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(plots.PlotError, match="cold.metrics.jsonl: holds no evaluations"):
        plots.load_runs([tmp_path / "cold"])
    _history(tmp_path / "cold.metrics.jsonl", [10, 20, 30])
    figure = plots.runs_figure(plots.load_runs([tmp_path / "warm.metrics.jsonl",
                                                tmp_path / "cold"]))
    titles = [ax.get_title() for ax in figure.axes]
    assert titles == ["train loss", "validation loss (nats)", "validation accuracy",
                      "frozen modules"]
    accuracy = figure.axes[2]
    assert [line.get_label() for line in accuracy.get_lines()] == ["warm", "cold"]
    assert list(accuracy.get_lines()[1].get_xdata()) == [2.0, 4.0, 6.0]  # training seconds
    assert accuracy.get_xlabel() == "training time (s)"
    frozen = figure.axes[3].yaxis.get_major_locator()
    assert isinstance(frozen, MaxNLocator) and frozen._integer  # whole modules
    # nothing froze (0 each evaluation) and one evaluation: no frozen panel, a dot from x = 0
    _history(tmp_path / "once.metrics.jsonl", [10], frozen=0)
    figure = plots.runs_figure(plots.load_runs([tmp_path / "once.metrics.jsonl"]))
    assert [ax.get_title() for ax in figure.axes][-1] == "validation accuracy"
    assert figure.axes[2].get_xlim() == (0.0, 4.0)
    assert figure.axes[2].get_lines()[0].get_marker() == "o"


RUN_JSON = {
    "devices": {"kind": "cpu", "count": 2},
    "plan": {"solver": "milp", "reason": "", "makespan_seconds": 30.0, "assignments": [
        {"job": "b", "node": "local", "gpus": 1, "parallelism": "single", "start": 0.0,
         "seconds": 20.0},
        {"job": "a", "node": "local", "gpus": 2, "parallelism": "ddp", "start": 20.0,
         "seconds": 10.0}]},
    "jobs": [{"name": "a", "state": "done", "start_seconds": 18.0, "end_seconds": 31.0},
             {"name": "b", "state": "done", "start_seconds": 0.5, "end_seconds": 18.0}],
}


def test_the_plan_gantt_has_a_row_per_job_in_start_order_with_planned_and_actual_bars() -> None:
    figure = plots.plan_figure(RUN_JSON)
    (ax,) = figure.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["b", "a"]
    assert ax.get_title() == "plan (milp) on 2 CPU slots, makespan 30 s planned, 31 s actual"
    assert sorted(t.get_text() for t in ax.texts) == ["ddp×2", "single×1"]
    widths = sorted(round(p.get_width(), 1) for p in ax.patches)
    assert widths == [10.0, 13.0, 17.5, 20.0]  # two planned, two actual
    assert ax.get_legend() is None  # below the axes, off the bars
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == ["planned", "actual"]
    gpus = plots.plan_figure({**RUN_JSON, "devices": {"kind": "cuda:NVIDIA H200", "count": 2}})
    assert " on 2 GPUs (NVIDIA H200), " in gpus.axes[0].get_title()


def _kiln(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    stderr = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(stderr):
        code = cli.main(list(argv))
    return code, out.getvalue() + stderr.getvalue()


def test_kiln_plot_writes_png_files_of_the_given_size(tmp_path: Path) -> None:
    warm = _history(tmp_path / "warm.metrics.jsonl", [10, 20])
    cold = _history(tmp_path / "cold.metrics.jsonl", [10, 20, 30])
    plan = tmp_path / "run.json"
    plan.write_text(json.dumps(RUN_JSON), encoding="utf-8")
    code, said = _kiln("plot", str(warm), str(cold), "--out", str(tmp_path / "curves.png"))
    assert code == 0, said
    assert image.imread(tmp_path / "curves.png").shape[:2] == (400, 3 * 450)  # 100 dpi
    code, said = _kiln("plot", "--plan", str(plan), "--out", str(tmp_path / "plan.png"))
    assert code == 0, said
    assert image.imread(tmp_path / "plan.png").shape[:2] == (220, 900)


def test_kiln_plot_finds_a_bare_job_name_in_kiln_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".kiln" / "runs").mkdir(parents=True)
    _history(tmp_path / ".kiln" / "runs" / "digits-a.metrics.jsonl", [10, 20])
    code, said = _kiln("plot", "digits-a", "--out", "a.svg")
    assert code == 0 and (tmp_path / "a.svg").read_text(encoding="utf-8").startswith("<?xml"), said


def test_kiln_plot_draws_the_history_a_zoo_record_keeps_by_model_id_or_job_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no .kiln/runs here: a cluster job's curves are in the zoo
    history = runner.read_history(_history(tmp_path / "h.metrics.jsonl", [10, 20, 30], frozen=1))
    zoo = store.DirStore(tmp_path / "zoo")
    zoofactory.add(zoo, "small_cnn-0001", floats=4, history=history, job_name="digits-a")
    assert plots.load_runs([Path("small_cnn-0001"), Path("digits-a")], zoo=zoo) == {
        "small_cnn-0001": history, "digits-a": history}
    code, said = _kiln("plot", "small_cnn-0001", "--zoo", "zoo", "--out", "a.png")
    assert code == 0, said
    assert image.imread(tmp_path / "a.png").shape[:2] == (400, 4 * 450)  # with the frozen panel
    code, said = _kiln("plot", "digits-a", "--zoo", "zoo", "--out", "b.png")
    assert code == 0 and (tmp_path / "b.png").stat().st_size > 0, said


@pytest.mark.parametrize(("name", "message"), [
    ("nothing-1234", ("nothing-1234: no `kiln run` history here (.kiln/runs/nothing-1234."
                      "metrics.jsonl) and no zoo model with this id or job name in")),
    ("old-0001", ("old-0001: zoo model old-0001 keeps no training history (registered by an "
                  "older trainer, or imported)")),
    ("job-twice", ("jobs of this name in several namespaces registered models (a-0001 "
                   "(team-a), b-0001 (team-b)); give the model id instead")),
])
def test_kiln_plot_of_a_zoo_name_says_what_is_missing_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    zoo = store.DirStore(tmp_path / "zoo")
    zoofactory.add(zoo, "old-0001", floats=4)  # registered without a history
    for record_id, namespace in (("a-0001", "team-a"), ("b-0001", "team-b")):
        zoofactory.add(zoo, record_id, floats=4, job_name="job-twice", namespace=namespace,
                       history=[{"step": 1, "validation_accuracy": 0.5}])
    code, said = _kiln("plot", name, "--zoo", "zoo", "--out", "x.png")
    assert code == 2 and message in " ".join(said.split()), said
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["plot", "--out", "x.png"], "give one of RUN files"),
    (["plot", "missing.metrics.jsonl", "--out", "x.png"],
     "cannot read .kiln/runs/missing.metrics.jsonl"),
    (["plot", "run.json", "--out", "x.png"], "give --plan run.json"),
    (["plot", "--plan", "plan.json", "--out", "x.png"], "--plan plan.json: expected run.json"),
    (["plot", "--plan", "run.json", "--out", "nowhere/x.png"], "--out nowhere/x.png"),
])
def test_kiln_plot_errors_name_the_file_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text('{"jobs": []}', encoding="utf-8")
    (tmp_path / "run.json").write_text(json.dumps(RUN_JSON), encoding="utf-8")
    code, said = _kiln(*argv)
    assert code == 2 and message in " ".join(said.split()), said


def test_a_log_gets_one_plain_line_per_evaluation_a_terminal_gets_none() -> None:
    for terminal in (False, True):
        out = io.StringIO()
        console = Console(file=out, width=200, force_terminal=terminal)
        with runner.new_progress(console) as progress:
            task = progress.add_task("digits", total=3, status="")
            runner.show(progress, task, _progress(5, accuracy=0.1, evaluated=False))
            runner.show(progress, task, _progress(10, accuracy=0.5))
        lines = [line for line in out.getvalue().splitlines() if "step 10:" in line]
        if terminal:
            assert not any(line.startswith("digits: epoch") for line in lines)
        else:  # and no bar: its last frame would only repeat the line, cut to the width
            assert "━" not in out.getvalue(), out.getvalue()
            assert lines == [("digits: epoch 2/3 step 10: loss 0.200  val acc 0.500  val loss "
                              "0.500  50 samples/s (2.0 s)")]


@pytest.mark.parametrize(("lines", "drawn"), [
    ('{"step": 1, "elapsed_seconds": "abc", "validation_accuracy": 0.5}\n', True),
    ('{"step": 1, "elapsed_seconds": [1], "validation_accuracy": {"a": 1}}\n', True),
    ('{"step": 1, "elapsed_seconds": Infinity, "validation_accuracy": NaN}\n', True),
    ('{"step": 2, "train_loss": "x", "frozen_modules": "lots"}\n{"step": -5}\n', True),
    ("[" * 100_000 + "\n", False),  # nested past the JSON reader's depth
    ('\xff\x00 torn\n{"step": 2', False),
])
def test_kiln_plot_of_a_hostile_history_draws_what_it_can_or_says_it_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: str, drawn: bool
) -> None:
    """A zoo record's history and a local one are user code's output: never a traceback."""
    monkeypatch.chdir(tmp_path)
    zoo = store.DirStore(tmp_path / "zoo")
    zoofactory.add(zoo, "bad-0001", floats=4, history=[{"step": 1}])
    (tmp_path / "zoo" / records.record_prefix("bad-0001") / records.HISTORY_NAME).write_text(
        lines, encoding="latin-1")  # so \xff is a byte no UTF-8 text holds
    (tmp_path / "bad.metrics.jsonl").write_text(lines, encoding="latin-1")
    for argv in (["bad-0001", "--zoo", "zoo"], ["bad.metrics.jsonl"]):
        code, said = _kiln("plot", *argv, "--out", "x.png")
        if drawn:
            assert code == 0 and (tmp_path / "x.png").stat().st_size > 0, said
        else:
            assert code == 2 and ("without evaluations" in said or "no evaluations" in said), said
            assert not (tmp_path / "x.png").exists()
