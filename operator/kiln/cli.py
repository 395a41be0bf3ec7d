"""The `kiln` command: run jobs locally, validate job files, inspect the zoo, run the operator.

Every user error is one message on stderr and a non-zero exit, never a traceback. Text from
users, zoo records and the trainer is printed as plain text, never as rich markup (a "[/]" in
a message would otherwise crash rich or restyle the output).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml
from rich.console import Console
from rich.markup import escape

# Only light modules here: `kiln --help`, `--version` and the zoo commands start without torch
# (about 2 s); commands import torch-backed modules (models, warm start, profiling) themselves.
import kiln
from kiln import api, contract, dashboard
from kiln.api import jobfile
from kiln.cluster import client as cluster_client
from kiln.cluster import errors as cluster_errors
from kiln.cluster import views
from kiln.local import output, runner, tables
from kiln.placement import profilecache, types
from kiln.zoo import records, store

DEFAULT_ZOO = ".kiln/zoo"
JOB_FILE_SUFFIXES = (".yaml", ".yml", ".json")
"""What a folder given for job files contributes, as `kubectl apply -f DIR` reads."""
STDIN = Path("-")
COMPLETION_SHELLS = ("bash", "zsh", "tcsh")
# `kiln zoo ls --sort`: record -> sort key. Metrics sort best first (accuracy down, loss up).
SORT_KEYS: dict[str, Callable[[records.ZooRecord], Any]] = {
    "created": lambda rec: rec.created_time,
    "id": lambda rec: rec.id,
    "metric": lambda rec: (rec.metric_name, rec.metric_value if rec.metric_name.endswith("loss")
                           else -rec.metric_value),
    "params": lambda rec: -rec.num_params,
}
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
EXIT_TIMEOUT = 124  # `kiln wait --timeout` ran out, as timeout(1) exits


class UsageError(Exception):
    """A user mistake in arguments or files: printed as one message, exit 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kiln` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["operator"]:  # the operator owns its flags (kiln.controller.settings)
        try:  # kopf and the MILP come with the `operator` extra; `kiln run` needs neither
            from kiln.controller import main as controller_main
        except ModuleNotFoundError as exc:
            print(f"kiln operator: error: {exc}; install the operator extra: pip install "
                  "'kiln-operator[operator]'", file=sys.stderr)
            return EXIT_USAGE
        return controller_main.main(argv[1:], prog="kiln operator")
    parser = _parser()
    args = parser.parse_args(argv)
    console, errors = output.stdout_console(), output.stderr_console()
    warnings.showwarning = functools.partial(_show_warning, errors)
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, functools.partial(_stop_on_sigterm, terminated))
    try:
        code: int = args.func(args, console)
        return code
    except (UsageError, api.InvalidSpec, store.StoreUnavailable, store.StoreMisconfigured,
            runner.JobBusy, profilecache.ProfileCacheError, cluster_errors.ClusterError) as exc:
        errors.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return EXIT_USAGE
    except runner.TrainerFailed as exc:
        errors.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return EXIT_FAILED
    except KeyboardInterrupt:
        errors.print("terminated" if terminated else "interrupted")
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_on_sigterm(terminated: list[int], signum: int, _frame: Any) -> None:
    """SIGTERM (a service manager, `kill`) stops the run as Ctrl-C does: running trainers
    checkpoint and stop; then exit 143."""
    terminated.append(signum)
    raise KeyboardInterrupt


def _show_warning(errors: Console, message: Warning | str, *_: Any, **__: Any) -> None:
    """Warnings (e.g. a skipped zoo record) as one plain line, without a source location."""
    errors.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {kiln.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="train jobs locally and register them in the zoo")
    run.add_argument("files", nargs="+", type=Path, metavar="FILE")
    run.add_argument("--slots", type=_positive_int, default=None, metavar="N",
                     help="devices for several jobs: CPU worker slots (default: half the cores)"
                     ", or at most N GPUs; 1 runs the jobs one after another in file order")
    run.add_argument("--profile-cache", type=Path, default=profilecache.DEFAULT_CACHE,
                     metavar="PATH", help="`kiln profile` results for estimates (default "
                     f"{profilecache.DEFAULT_CACHE})")
    _zoo_options(run)
    output.add_option(run)
    run.set_defaults(func=_cmd_run)

    sweep = sub.add_parser("sweep", help="run a TrainingSweep here, or show a sweep's "
                           "leaderboard")
    sweep_sub = sweep.add_subparsers(dest="sweep_command", required=True, metavar="ACTION")
    sweep_run = sweep_sub.add_parser(
        "run", help="run a sweep's trials here (a rerun resumes it)",
        description="Run a TrainingSweep's trials on this machine as `kiln run` runs jobs, at "
        "most min(spec.parallelTrials, --slots) at once. Its state is kept in "
        ".kiln/runs/NAME.sweep.json: after Ctrl-C, the same command resumes it.")
    sweep_run.add_argument("file", type=Path, metavar="SWEEP.yaml")
    sweep_run.add_argument("--slots", type=_positive_int, default=None, metavar="N",
                           help="trials at once, at most spec.parallelTrials: CPU worker slots "
                           "(default: half the cores), or at most N GPUs")
    _zoo_options(sweep_run)
    output.add_option(sweep_run)
    sweep_run.set_defaults(func=_cmd_sweep_run)
    sweep_show = sweep_sub.add_parser(
        "show", help="a sweep's leaderboard, best values and best zoo model",
        description="Show a sweep: a name run here (.kiln/runs/NAME.sweep.json), a "
        "TrainingSweep file, or - for stdin (kubectl get tsw NAME -o yaml | kiln sweep show -).")
    sweep_show.add_argument("sweep", metavar="NAME|FILE|-")
    output.add_option(sweep_show)
    sweep_show.set_defaults(func=_cmd_sweep_show)

    prof = sub.add_parser("profile", help="time one training step per config (for the planner)")
    prof.add_argument("file", type=Path, metavar="FILE")
    prof.add_argument("--configs", type=_configs, default=None, metavar="P:K,...",
                      help="configs to time, e.g. single:1,ddp:2 (default: every config that "
                      "can run here)")
    prof.add_argument("--cache", type=Path, default=profilecache.DEFAULT_CACHE, metavar="PATH",
                      help=f"profile cache (default {profilecache.DEFAULT_CACHE})")
    prof.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    prof.add_argument("--refresh", action="store_true", help="measure again even when cached")
    output.add_option(prof)
    prof.set_defaults(func=_cmd_profile)

    validate = sub.add_parser("validate", help="check job files (exit 2 when invalid)")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE",
                          help=f"a job file, a folder (its {', '.join(JOB_FILE_SUFFIXES)} files) "
                          "or - for stdin")
    validate.add_argument("--runtime", action="append", type=Path, default=[], metavar="FILE",
                          help="a file of TrainingRuntime or ClusterTrainingRuntime documents "
                          "that jobs name in spec.runtimeRef (repeatable; a job file may hold "
                          "its runtime too)")
    output.add_option(validate)
    validate.set_defaults(func=_cmd_validate)

    zoo = sub.add_parser("zoo", help="inspect the model zoo")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True, metavar="ACTION")
    ls = zoo_sub.add_parser("ls", help="list models")
    ls.add_argument("--namespace", default=None, metavar="NS", type=_namespace,
                    help="only the models a job in NS sees: NS's own and shared ones "
                    "(default: every model)")
    ls.add_argument("--architecture", default=None, metavar="NAME",
                    help="only models of this architecture (or entrypoint)")
    ls.add_argument("--dataset", default=None, metavar="NAME",
                    help="only models trained on this dataset")
    ls.add_argument("--sort", choices=SORT_KEYS, default="created",
                    help="order: created (oldest first, the default), id, metric (best first), "
                    "params (largest first)")
    _zoo_options(ls)
    output.add_option(ls)
    ls.set_defaults(func=_cmd_zoo_ls)
    show = zoo_sub.add_parser("show", help="show one model's record")
    show.add_argument("model_id", metavar="ID")
    show.add_argument("--namespace", default=None, metavar="NS", type=_namespace,
                      help="refuse a model private to another namespace than NS")
    _zoo_options(show)
    output.add_option(show)
    show.set_defaults(func=_cmd_zoo_show)
    rm = zoo_sub.add_parser("rm", help="delete models (also half-written ones)")
    rm.add_argument("model_ids", nargs="+", metavar="ID")
    rm.add_argument("--force", action="store_true",
                    help="delete a LoRA base even though adapters in the zoo still use it "
                    "(they can then no longer be loaded or exported)")
    _zoo_options(rm)
    rm.set_defaults(func=_cmd_zoo_rm)

    imp = zoo_sub.add_parser(
        "import", help="register pretrained weights: a .safetensors file, a Hugging Face "
        "directory or a torch state dict")
    imp.add_argument("weights", type=Path, metavar="WEIGHTS")
    imp.add_argument("--job", type=Path, default=None, metavar="FILE",
                     help="take the model (spec.model) from this job file; its folder goes on "
                     "the Python path, as with `kiln run`")
    imp.add_argument("--entrypoint", default=None, metavar="MODULE:CALLABLE",
                     help="the model's builder in your code (the current directory and "
                     "PYTHONPATH are searched)")
    imp.add_argument("--architecture", default=None, metavar="NAME",
                     help="a registered architecture (`kiln models`)")
    imp.add_argument("--args", default="{}", metavar="JSON",
                     help='the builder\'s keyword arguments as a JSON object, e.g. {"n_layer": 4}')
    imp.add_argument("--input-shape", default=None, metavar="DIMS",
                     help="one sample's shape without the batch, e.g. 3,32,32 or 64")
    imp.add_argument("--task", choices=[str(t) for t in api.ModelTask], default=None,
                     help="what the output means (default: the registry's, or classification)")
    imp.add_argument("--metric", default=None, metavar="NAME=VALUE",
                     help="what the weights were evaluated at, e.g. validation_accuracy=0.91 "
                     "(required, except for a `kiln zoo export` folder, which brings its own)")
    imp.add_argument("--source", default=None, metavar="TEXT",
                     help="where the weights came from, e.g. a URL (default: the path)")
    imp.add_argument("--license", default=None, metavar="TEXT", help="the weights' license")
    imp.add_argument("--dataset", default="imported", metavar="NAME", type=_one_line,
                     help="what they were trained on (informational)")
    imp.add_argument("--namespace", default=records.LEGACY_NAMESPACE, metavar="NS",
                     type=_namespace,
                     help="the namespace whose jobs may warm-start from them (default: default)")
    imp.add_argument("--share", choices=[str(s) for s in api.ZooShare],
                     default=api.ZooShare.PRIVATE.value,
                     help="private (only jobs of --namespace see them, the default) or shared "
                     "(every namespace)")
    _zoo_options(imp)
    imp.set_defaults(func=_cmd_zoo_import)

    query = zoo_sub.add_parser("query", help="rank the zoo models a job would warm-start from")
    query.add_argument("file", type=Path, metavar="FILE")
    query.add_argument("--top", type=_positive_int, default=5, metavar="K",
                       help="how many candidates to show (default 5)")
    _zoo_options(query)
    output.add_option(query)
    query.set_defaults(func=_cmd_zoo_query)

    gc = zoo_sub.add_parser("gc", help="evict the models worth least per byte (decayed parent "
                            "hits) until the zoo fits --capacity")
    gc.add_argument("--capacity", required=True, type=_size, metavar="SIZE",
                    help="the zoo's budget, e.g. 10GiB or 500MB")
    gc.add_argument("--dry-run", action="store_true",
                    help="print what would be deleted, delete nothing")
    gc.add_argument("--half-life-days", type=_positive_float, default=7.0, metavar="DAYS",
                    help="a parent hit's weight halves every DAYS days (default 7)")
    _zoo_options(gc)
    output.add_option(gc)
    gc.set_defaults(func=_cmd_zoo_gc)

    exp = zoo_sub.add_parser("export", help="write a model as a folder: safetensors weights, "
                             "graph, meta.json and a README with a loading snippet")
    exp.add_argument("model_id", metavar="ID")
    exp.add_argument("--out", required=True, type=Path, metavar="DIR",
                     help="the folder to write (created; must not hold an export already)")
    _zoo_options(exp)
    exp.set_defaults(func=_cmd_zoo_export)

    lin = zoo_sub.add_parser("lineage", help="a model's parents and descendants, with "
                             "similarities and the training each warm start inherited")
    lin.add_argument("model_id", metavar="ID")
    _zoo_options(lin)
    output.add_option(lin)
    lin.set_defaults(func=_cmd_zoo_lineage)

    models_cmd = sub.add_parser("models", help="list registered architectures")
    output.add_option(models_cmd)
    models_cmd.set_defaults(func=_cmd_models)

    completion = sub.add_parser(
        "completion", help="print a shell completion script (bash, zsh, tcsh)",
        description="Print a shell completion script, e.g. for bash: kiln completion bash > "
        "~/.local/share/bash-completion/completions/kiln")
    completion.add_argument("shell", choices=COMPLETION_SHELLS)
    completion.set_defaults(func=_cmd_completion)

    sub.add_parser("operator", add_help=False,
                   help="run the operator against a Kubernetes API server (see --help)")

    # Developer commands, left out of the user's help (a subcommand without help= is not
    # listed): they print by default (`kiln crd | kubectl apply -f -`); --write regenerates
    # the repository's copies.
    crd_cmd = sub.add_parser("crd", description="Print Kiln's CRDs (jobs, sweeps, runtimes) "
                             "generated from kiln.api (one YAML stream).")
    crd_cmd.add_argument("--kind", choices=("TrainingJob", "TrainingSweep", "TrainingRuntime",
                                            "ClusterTrainingRuntime"),
                         help="only this kind's CRD (and reference page)")
    crd_where = crd_cmd.add_mutually_exclusive_group()
    crd_where.add_argument("--out", action="append", type=Path, metavar="PATH",
                           help="write it here instead (repeatable; - is stdout)")
    crd_where.add_argument("--write", action="store_true",
                           help="in the repository root: regenerate crds/<kind>.yaml, the Helm "
                           "chart's copies, the zoo record schema and the field references")
    crd_cmd.add_argument("--reference", type=Path, metavar="PATH",
                         help="the field reference page to regenerate, of --kind (default "
                              "TrainingJob); default with --write: docs/reference/<kind>.md "
                              "where it exists")
    crd_cmd.set_defaults(func=_cmd_crd)

    dash = sub.add_parser("dashboard",
                          description="Print the Grafana dashboard generated from kiln.dashboard.")
    dash_where = dash.add_mutually_exclusive_group()
    dash_where.add_argument("--out", action="append", type=Path, metavar="PATH",
                            help="write it here instead (repeatable; - is stdout)")
    dash_where.add_argument("--write", action="store_true",
                            help=f"in the repository root: regenerate {dashboard.CHART_COPY}")
    dash.set_defaults(func=_cmd_dashboard)

    plot = sub.add_parser("plot", help="draw runs' training curves, a sweep's trials or a "
                          "placement plan (PNG, SVG or PDF, by the --out suffix)")
    plot.add_argument("runs", nargs="*", type=Path, metavar="RUN",
                      help="a run's history (.kiln/runs/JOB.metrics.jsonl, its log, or a bare "
                      "JOB name, looked up in .kiln/runs/), else a zoo model id or the job name "
                      "of a zoo record (a cluster job's curves, stored with its model; see "
                      "--zoo); several draw side by side, e.g. warm vs cold")
    plot.add_argument("--plan", type=Path, metavar="PLAN.json",
                      help="draw this plan as a Gantt chart instead (`kiln run --slots` "
                      "writes .kiln/runs/run.json)")
    plot.add_argument("--sweep", metavar="NAME|FILE|-",
                      help="draw every trial of a sweep instead: its objective per epoch, "
                      "pruned trials dashed (a name run here, a TrainingSweep file, or -)")
    plot.add_argument("--x", choices=("time", "step"), default=None,
                      help="x axis of RUN curves: training seconds (default) or optimizer "
                      "steps (a sweep's trials are drawn per epoch, a plan over time)")
    plot.add_argument("--out", type=Path, required=True, metavar="FILE.png",
                      help="image to write; its suffix picks the format: .png, .svg or .pdf")
    _zoo_options(plot)
    plot.set_defaults(func=_cmd_plot)
    _cluster_commands(sub)
    return parser


def _cmd_plot(args: argparse.Namespace, console: Console) -> int:
    if [bool(args.runs), args.plan is not None, args.sweep is not None].count(True) != 1:
        raise UsageError("kiln plot: give one of RUN files (training curves), --plan "
                         "PLAN.json (a Gantt chart) or --sweep NAME (a sweep's trials)")
    if args.x is not None and not args.runs:
        raise UsageError(f"--x {args.x}: only RUN curves take another x axis; a sweep's "
                         "trials are drawn per epoch and a plan over time, so leave --x out")
    try:  # matplotlib is an extra: `kiln run` never needs it
        from kiln.local import plots
    except ImportError as exc:
        raise UsageError(f"kiln plot needs matplotlib ({exc}); pip install "
                         "'kiln-operator[plot]'") from None
    try:
        if args.sweep is not None:
            figure = plots.sweep_figure(_load_sweep(args.sweep))
        elif args.plan is not None:
            figure = plots.plan_figure(plots.load_plan(args.plan))
        else:  # the zoo, only for names that are no history file here
            in_zoo = any(plots.zoo_name(run) is not None for run in args.runs)
            figure = plots.runs_figure(
                plots.load_runs(args.runs, zoo=_open_zoo(args) if in_zoo else None),
                x_key="step" if args.x == "step" else "elapsed_seconds")
        plots.save(figure, args.out)
    except plots.PlotError as exc:
        raise UsageError(str(exc)) from None
    console.print(f"wrote {escape(str(args.out))}", highlight=False)
    return EXIT_OK


def _zoo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--zoo", default=os.environ.get(contract.Env.ZOO, DEFAULT_ZOO), metavar="URI",
        help="zoo location: a directory or s3://bucket[/prefix] (default: $KILN_ZOO or "
        f"{DEFAULT_ZOO})",
    )
    parser.add_argument(
        "--zoo-endpoint", default=None, metavar="HOST:PORT",
        help="S3 endpoint for s3:// zoos (default: $KILN_ZOO_ENDPOINT); credentials come from "
        "$KILN_ZOO_ACCESS_KEY and $KILN_ZOO_SECRET_KEY",
    )


def _zoo_env(args: argparse.Namespace) -> dict[str, str]:
    return {contract.Env.ZOO_ENDPOINT: args.zoo_endpoint} if args.zoo_endpoint else {}


def _open_zoo(args: argparse.Namespace, *, writes: bool = False) -> store.ObjectStore:
    """The zoo --zoo names; `writes`: the command trains into it, so a directory zoo that
    cannot be written is refused now, before any training, not at registration."""
    os.environ.update(_zoo_env(args))
    try:
        zoo = store.open_store(args.zoo)
    except ValueError as exc:
        raise UsageError(f"--zoo {args.zoo}: {exc}") from None
    if writes and isinstance(zoo, store.DirStore):
        try:
            zoo.check_writable()
        except store.StoreUnavailable as exc:
            raise UsageError(f"--zoo {args.zoo}: {exc}; trained models and checkpoints are "
                             "written there: pass --zoo a writable directory (or set "
                             f"${contract.Env.ZOO})") from None
    return zoo


def _run_work_dir(errors: Console, sweep_name: str | None = None) -> Path:
    """Where `kiln run` and `kiln sweep run` keep their state: ./.kiln/runs (made now), or,
    when that cannot be written, a temp folder, said on stderr with where it is (a rerun here,
    or `kiln sweep show NAME`, looks only in ./.kiln/runs)."""
    work_dir = runner.default_work_dir()
    if work_dir != runner.RUNS:
        from kiln.local import sweep as local_sweep

        show = (f"; see it with: kiln sweep show {local_sweep.state_path(work_dir, sweep_name)}"
                if sweep_name else "")
        _show_warning(errors, f"{runner.RUNS.absolute()} cannot be written, so this run keeps its "
                      f"state in {work_dir}, where a rerun here will not find it{show}")
    return work_dir


def _job_files(paths: Sequence[Path]) -> list[Path]:
    """`paths` with each folder replaced by its job files (sorted, not recursive, no hidden
    files); files and - (stdin) stay as given.

    Raises:
        UsageError: a folder holds no job file.
    """
    files = []
    for path in paths:
        if path != STDIN and path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in JOB_FILE_SUFFIXES
                           and not p.name.startswith(".") and p.is_file())
            if not found:
                raise UsageError(f"{path}: the folder holds no job file "
                                 f"({', '.join(JOB_FILE_SUFFIXES)}); give files or another folder")
            files += found
        else:
            files.append(path)
    return files


def _read_jobs(path: Path) -> list[api.TrainingJob]:
    """The jobs of one job file, or of stdin for -.

    Raises:
        api.InvalidSpec: as `jobfile.load_jobs`.
    """
    if path != STDIN:
        return jobfile.load_jobs(path)
    return jobfile.parse_jobs(_stdin_text(), source="<stdin>")


def _read_documents(path: Path, runtimes: Sequence[api.runtime.AnyRuntime] = ()
                    ) -> list[jobfile.Document]:
    """The jobs, sweeps and runtimes of one file, or of stdin for -.

    Raises:
        api.InvalidSpec: as `jobfile.parse_all`.
    """
    if path != STDIN:
        return jobfile.load_all(path, runtimes=runtimes)
    return jobfile.parse_all(_stdin_text(), source="<stdin>", runtimes=runtimes)


def _stdin_text() -> str:
    try:
        return sys.stdin.read()
    except UnicodeDecodeError:
        raise api.InvalidSpec(["stdin is not UTF-8 text"], source="<stdin>") from None


def _checked_documents(path: Path, runtimes: Sequence[api.runtime.AnyRuntime] = ()
                       ) -> list[jobfile.Document]:
    """The jobs and sweeps of one file (- for stdin), each checked against the model registry
    as the operator's admission checks it: a job as `kiln run` runs it, a sweep at every trial
    value (`models.check_sweep`).

    Raises:
        UsageError: every problem of the file's first invalid document, naming its fields.
    """
    from kiln import models

    try:
        found = _read_documents(path, runtimes)
        known = [*runtimes, *(d for d in found if isinstance(d, api.runtime.AnyRuntime))]
        for i, doc in enumerate(found):
            source = ("<stdin>" if path == STDIN else str(path)) + (
                f"[{i}]" if len(found) > 1 else "")  # as the parser names it
            if isinstance(doc, api.runtime.AnyRuntime):
                continue  # its template is all there is to check, and was
            if isinstance(doc, api.sweep.TrainingSweep):
                more = models.check_sweep(doc)
            else:  # on its runtime, when given, as the operator runs it
                named = api.runtime.find(doc.spec.runtime_ref, known, doc.metadata.namespace)
                more = models.check_job(api.runtime.on(doc, api.runtime.record(named))
                                        if named else doc)
            if more:
                raise api.InvalidSpec(more, source=source, kind=doc.kind)
    except api.InvalidSpec as exc:  # a job or sweep that did not parse: add what can be told
        problems = (models.check_job(exc) if exc.kind == api.KIND
                    else models.check_sweep(exc) if exc.kind == api.sweep.SWEEP_KIND
                    else exc.problems)
        raise UsageError(str(api.InvalidSpec(problems, source=exc.source, kind=exc.kind))
                         ) from None
    return found


def _load_all(files: Sequence[Path]) -> list[api.TrainingJob]:
    from kiln import models

    jobs, problems = [], []
    for path in _job_files(files):
        try:
            for job in _read_jobs(path):
                more = models.check_job(job)
                if more:
                    raise api.InvalidSpec(more, source=str(path))
                jobs.append(job)
        except api.InvalidSpec as exc:  # a document that did not parse: add what can be told
            told = models.check_job(exc) if exc.kind == api.KIND else exc.problems
            problems.append(str(api.InvalidSpec(told, source=exc.source, kind=exc.kind)))
    names = [j.name for j in jobs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"metadata.name: each job needs its own name; repeated: {duplicates}")
    if problems:
        raise UsageError("\n".join(problems))
    return jobs


def _cmd_validate(args: argparse.Namespace, console: Console) -> int:
    invalid: list[str] = []
    names: list[tuple[str, str]] = []
    rows: list[dict[str, Any]] = []
    try:
        runtimes = [r for path in args.runtime for r in jobfile.load_runtimes(path)]
    except api.InvalidSpec as exc:
        raise UsageError(str(exc)) from None
    for path in _job_files(args.files):  # each file on its own: the valid ones are said valid
        source = "<stdin>" if path == STDIN else str(path)
        try:
            found = _checked_documents(path, runtimes)
        except UsageError as exc:
            invalid.append(str(exc))
            lines = str(exc).splitlines()  # "FILE: invalid TrainingJob:", then "  problem"s
            rows.append({"source": source, "name": _name_as_written(path), "valid": False,
                         "problems": [ln.strip() for ln in lines if ln.startswith("  ")] or lines})
            continue
        known = [*runtimes, *(d for d in found if isinstance(d, api.runtime.AnyRuntime))]
        for doc in found:
            if not isinstance(doc, (api.TrainingJob, api.sweep.TrainingSweep)):
                names.append((doc.kind, doc.metadata.name))
                rows.append({"source": source, "kind": doc.kind, "name": doc.metadata.name,
                             "valid": True, "problems": [], "locked": doc.spec.locked})
                if args.output == "table":
                    console.print(f"[green]valid[/]: {escape(doc.metadata.name)} ({doc.kind})")
                continue
            spec = doc.spec.template if isinstance(doc, api.sweep.TrainingSweep) else doc.spec
            names.append((doc.kind, doc.name))
            row: dict[str, Any] = {
                "source": source, "kind": doc.kind, "name": doc.name, "valid": True,
                "problems": [], "model": spec.model.label, "dataset": spec.dataset.source}
            what = f"{escape(spec.model.label)} on {spec.dataset.source}"
            if isinstance(doc, api.sweep.TrainingSweep):
                paths = [p.path for p in doc.spec.parameters]
                row |= {"parameters": paths, "maxTrials": doc.spec.trial_budget}
                what = (f"sweep of {doc.spec.trial_budget} trials over {escape(', '.join(paths))}"
                        f"; {what}")
            ref = spec.runtime_ref
            if ref is not None:
                given = api.runtime.find(ref, known, doc.metadata.namespace) is not None
                row["runtime"] = {"kind": ref.kind, "name": ref.name, "checked": given}
                what += (f"; on {ref.kind} {escape(ref.name)}" if given else
                         f"; {ref.kind} {escape(ref.name)} not given, so its settings were "
                         "not checked (--runtime FILE)")
            rows.append(row)
            if args.output == "table":
                console.print(f"[green]valid[/]: {escape(doc.name)} ({what})")
    repeated = sorted({key for key in names if names.count(key) > 1})  # a name per kind
    nouns = {api.KIND: "job", api.sweep.SWEEP_KIND: "sweep",
             api.runtime.RUNTIME_KIND: "runtime", api.runtime.CLUSTER_RUNTIME_KIND: "runtime"}
    for kind, noun in nouns.items():
        if same := [name for k, name in repeated if k == kind]:
            invalid.append(f"metadata.name: each {noun} needs its own name; repeated: {same}")
    for row in rows:
        if (row.get("kind"), row["name"]) in repeated:
            row["valid"] = False
            row["problems"] = [f"metadata.name: another {nouns[row['kind']]} has this name"]
    if args.output != "table":  # every file's verdict on stdout; the problems on stderr too
        output.show(console, args.output, rows)
    if invalid:  # each file's own "error:" line, as the first one gets
        raise UsageError("\nerror: ".join(invalid))
    return EXIT_OK


def _name_as_written(path: Path) -> str | None:
    """metadata.name of a one-document file that did not validate, as written (None for
    stdin, several documents, or none readable)."""
    if path == STDIN:
        return None
    try:
        docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    meta = docs[0].get("metadata") if len(docs) == 1 and isinstance(docs[0], dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else None


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    from kiln.local import machine, runplan

    # With -o json/yaml, stdout carries only the results; progress and the plan go to stderr.
    results_console = console
    if args.output != "table":
        console = output.stderr_console()
    jobs = _load_all(args.files)
    for job in jobs:
        path = job.spec.dataset.path
        if path and not path.startswith("s3://") and not Path(path).exists():
            raise UsageError(f"{job.name}: spec.dataset.path: {path} does not exist here; point it "
                             "at the data (paths are relative to the current directory)")
    zoo = _open_zoo(args, writes=True)  # fail fast on a bad zoo before any training starts
    _check_pinned_parents(jobs, zoo)
    work_dir = _run_work_dir(output.stderr_console())
    python_path = runner.python_path(_job_files(args.files), os.environ)  # entrypoints there
    try:
        machine.check_slots(args.slots)
        devices = machine.local_devices(args.slots) if len(jobs) > 1 and args.slots != 1 else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    env = {**_zoo_env(args), **python_path}
    env |= runner.initialize(jobs, work_dir=work_dir, console=console, env=env)
    if devices is None or devices.count < 2:  # one job or one device: in file order
        outcomes = runner.run_jobs(jobs, zoo_uri=args.zoo, work_dir=work_dir, console=console,
                                  env=env)
    else:
        profiled = runplan.profile_jobs(jobs, devices=devices, zoo_uri=args.zoo,
                                        work_dir=work_dir, console=console,
                                        profile_cache=args.profile_cache, env=env)
        try:
            the_plan, configs = runplan.make_plan(jobs, devices=devices, zoo=zoo,
                                                  profile_cache=args.profile_cache,
                                                  profiled=profiled)
        except types.Unplaceable as exc:
            raise UsageError(f"{exc}; this machine has {devices.count} {devices.noun} "
                             "(--slots)") from None
        output.print_table(console, tables.plan(the_plan, configs, devices))  # before the run
        outcomes = runplan.run_planned(jobs, the_plan=the_plan, configs=configs,
                                       devices=devices, zoo_uri=args.zoo, work_dir=work_dir,
                                       console=console, env=env, profiled=profiled)
    rows = [{"name": o.name, "architecture": o.architecture, **o.result,
             "placement": dataclasses.asdict(o.placement) if o.placement else None}
            for o in outcomes]
    output.show(results_console, args.output, rows, tables.results(outcomes))
    return EXIT_OK


def _cmd_sweep_run(args: argparse.Namespace, console: Console) -> int:
    from kiln import models
    from kiln.local import sweep as local_sweep

    results_console = console  # with -o json/yaml stdout carries only the sweep's document
    if args.output != "table":
        console = output.stderr_console()
    given = local_sweep.read_sweep(args.file)
    problems = models.check_sweep(given)
    if problems:
        raise api.InvalidSpec(problems, source=str(args.file), kind=api.sweep.SWEEP_KIND)
    path = given.spec.template.dataset.path
    if path and not path.startswith("s3://") and not Path(path).exists():
        raise UsageError(f"{args.file}: spec.template.dataset.path: {path} does not exist here; "
                         "point it at the data (paths are relative to the current directory)")
    zoo = _open_zoo(args, writes=True)  # fail fast on a bad zoo before any training starts
    work_dir = _run_work_dir(output.stderr_console(), given.name)
    try:
        devices = local_sweep.devices_for(given.spec, args.slots)
        swept = local_sweep.resumed(given, local_sweep.state_path(work_dir, given.name))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    run = local_sweep.SweepRun(swept, devices=devices, zoo_uri=args.zoo, zoo=zoo,
                               work_dir=work_dir, console=console,
                               env={**_zoo_env(args), **runner.python_path([args.file],
                                                                           os.environ)})
    done = run.run()
    _show_sweep(results_console, args.output, done, wall_seconds=run.wall_seconds)
    return EXIT_FAILED if done.status and done.status.phase is api.sweep.SweepPhase.FAILED \
        else EXIT_OK


def _cmd_sweep_show(args: argparse.Namespace, console: Console) -> int:
    _show_sweep(console, args.output, _load_sweep(args.sweep))
    return EXIT_OK


def _load_sweep(given: str) -> api.sweep.TrainingSweep:
    """A sweep by name (run here), TrainingSweep file, or - (stdin).

    Raises:
        UsageError: none of these.
        api.InvalidSpec: the document is not a valid TrainingSweep.
    """
    from kiln.local import sweep as local_sweep

    if given == "-":
        try:
            return local_sweep.read_sweep(Path("<stdin>"), sys.stdin.read())
        except UnicodeDecodeError:
            raise api.InvalidSpec(["stdin is not UTF-8 text"], source="<stdin>") from None
    path = Path(given)
    if path.is_file():
        swept = local_sweep.read_sweep(path)
        state = local_sweep.state_path(runner.RUNS, swept.name)
        if (swept.status is None or not swept.status.history) and state.is_file():
            # The file a sweep was run from holds no results; its run here does.
            output.stderr_console().print(
                f"{given} has no trials; showing sweep {swept.name} as run here ({state})",
                markup=False, highlight=False, soft_wrap=True)
            return local_sweep.read_sweep(state)
        return swept
    if path.is_dir():
        raise UsageError(f"{given} is a folder; give a TrainingSweep file, a sweep's name, or - "
                         "to read one from stdin")
    state = local_sweep.state_path(runner.RUNS, given)  # read only: no folder made
    if state.is_file():
        return local_sweep.read_sweep(state)
    raise UsageError(f"{given}: no such file, and no sweep of that name was run here ({state}); "
                     "give a sweep's name, a TrainingSweep file, or - to read one from stdin "
                     "(kubectl get tsw NAME -o yaml | kiln sweep show -)")


def _show_sweep(console: Console, fmt: str, swept: api.sweep.TrainingSweep, *,
                wall_seconds: float | None = None) -> None:
    from kiln.local import sweep as local_sweep

    if fmt != "table":  # the TrainingSweep document with its status
        output.show(console, fmt, api.to_wire(swept))
        return
    # On a narrow terminal the full table folds every cell over several lines.
    compact = console.is_terminal and console.width < local_sweep.COMPACT_BELOW_COLUMNS
    output.print_table(console, tables.leaderboard(swept, compact=compact))
    for line in local_sweep.summary(swept, wall_seconds=wall_seconds):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if compact:
        console.print(f"(zoo models and why trials were pruned: kiln sweep show {swept.name} "
                      "-o yaml, or a terminal at least "
                      f"{local_sweep.COMPACT_BELOW_COLUMNS} columns wide)", markup=False,
                      highlight=False, soft_wrap=True)


def _cmd_profile(args: argparse.Namespace, console: Console) -> int:
    from kiln import models
    from kiln.placement import estimate, profile

    jobs = _load_all([args.file])
    if len(jobs) != 1:
        raise UsageError(f"{args.file}: holds {len(jobs)} jobs; profile one job at a time")
    job = jobs[0]
    if args.device == "cuda" and profile.device_type("cuda") == "cpu":
        raise UsageError("--device cuda: CUDA is not available here (no GPU, or a CPU-only "
                         "torch); use --device cpu or --device auto")
    if job.spec.model.entrypoint is not None:  # as `kiln run` does: the job file's folder
        os.environ.update(runner.python_path([args.file], os.environ))  # torchrun workers
        sys.path.insert(0, str(Path(args.file).resolve().parent))
    try:
        measured = profile.profile_job(job, configs=args.configs, cache_path=args.cache,
                                       device=args.device, refresh=args.refresh)
    except models.EntrypointError as exc:
        raise UsageError(f"{args.file}: {exc}") from None
    kind = profile.device_type(args.device)
    batch_size = estimate.workload(job).batch_size
    rows = [{"job": job.name, "device": kind, **dataclasses.asdict(m),
             "samples_per_second": batch_size / m.step_seconds if m.step_seconds else None}
            for m in measured]
    output.show(console, args.output, rows,
                tables.profile_table(job, measured, kind=kind, cache=args.cache))
    return EXIT_OK


def _configs(text: str) -> list[tuple[str, int]]:
    """`single:1,ddp:2` -> [("single", 1), ("ddp", 2)]."""
    pairs = []
    for part in filter(None, text.split(",")):
        name, _, k = part.strip().partition(":")
        if name not in types.PARALLELISMS or not k.isdigit() or int(k) < 1:
            raise argparse.ArgumentTypeError(
                f"{part!r}: expected PARALLELISM:K with PARALLELISM one of "
                f"{', '.join(types.PARALLELISMS)} and K >= 1, e.g. single:1,ddp:2")
        pairs.append((name, int(k)))
    if not pairs:
        raise argparse.ArgumentTypeError("no configs given; e.g. single:1,ddp:2")
    return pairs


def _check_pinned_parents(jobs: Sequence[api.TrainingJob], zoo: store.ObjectStore) -> None:
    """Every pinned spec.warmStart.parent is a usable record of `zoo`, checked before training.

    Raises:
        UsageError: naming each job whose pinned parent is missing or damaged.
        store.StoreUnavailable: the zoo could not be read.
    """
    from kiln.warmstart import decision

    problems = []
    for job in jobs:
        warm = job.spec.warm_start
        if warm.enabled and warm.parent != "auto":
            try:
                decision.pinned_record(zoo, warm.parent, namespace=job.namespace)
            except api.InvalidSpec as exc:
                problems += [f"{job.name}: {problem}" for problem in exc.problems]
    if problems:
        raise UsageError("\n".join(problems))


def _cmd_zoo_ls(args: argparse.Namespace, console: Console) -> int:
    zoo = _open_zoo(args)
    found = sorted(records.list_records(zoo), key=SORT_KEYS[args.sort])
    if args.namespace is not None:
        found = [rec for rec in found if rec.visible_to(args.namespace)]
    if args.architecture is not None:
        found = [rec for rec in found if args.architecture in (rec.builder, rec.architecture)]
    if args.dataset is not None:
        found = [rec for rec in found if rec.dataset == args.dataset]
    output.show(console, args.output, [json.loads(rec.to_json()) for rec in found],
                tables.zoo_models(zoo.describe(), found))  # scripts get whole records
    return EXIT_OK


def _model_id(text: str) -> records.ZooModelId:
    """A zoo model id from the command line.

    Raises:
        UsageError: it cannot be an id (empty, a path, odd characters).
    """
    try:
        return records.check_id(text)
    except ValueError as exc:
        raise UsageError(f"{exc}; `kiln zoo ls` lists the ids") from None


def _cmd_zoo_show(args: argparse.Namespace, console: Console) -> int:
    model_id = _model_id(args.model_id)
    zoo = _open_zoo(args)
    try:
        rec = records.read_record(zoo, model_id)
    except store.ObjectNotFound:
        raise UsageError(f"no zoo model {args.model_id!r} in {zoo.describe()}; "
                         "`kiln zoo ls` lists them") from None
    except records.CorruptRecord as exc:
        raise UsageError(str(exc)) from None
    if args.namespace is not None and not rec.visible_to(args.namespace):
        raise UsageError(f"zoo model {model_id} is private to namespace {rec.namespace}; "
                         f"`kiln zoo ls --namespace {args.namespace}` lists what "
                         f"{args.namespace} sees")
    if args.output == "table":  # people get the record as highlighted JSON
        console.print_json(rec.to_json())
    else:
        output.show(console, args.output, json.loads(rec.to_json()))
    return EXIT_OK


def _cmd_zoo_rm(args: argparse.Namespace, console: Console) -> int:
    model_ids = [_model_id(text) for text in args.model_ids]  # all checked before any delete
    zoo = _open_zoo(args)
    # An adapter is its base's weights plus a small difference: deleting the base alone would
    # leave adapters that can never be loaded or exported again.
    orphans: dict[str, list[str]] = {}
    if not args.force:
        for record in sorted(records.list_records(zoo), key=lambda r: r.id):
            if record.base in model_ids and record.id not in model_ids:
                orphans.setdefault(record.base, []).append(record.id)
    if orphans:
        used = "; ".join(f"{base} by {', '.join(ids)}" for base, ids in orphans.items())
        adapters = " ".join(i for ids in orphans.values() for i in ids)
        raise UsageError(f"not deleted: LoRA adapters in {zoo.describe()} use these bases: "
                         f"{used}; delete the adapters with them (kiln zoo rm {adapters} "
                         f"{' '.join(orphans)}), or add --force to leave the adapters "
                         "without their base")
    missing = []
    for model_id in model_ids:
        prefix = records.record_prefix(model_id)
        if zoo.exists(prefix + records.META_NAME):
            records.delete_record(zoo, model_id)
            console.print(f"deleted {model_id}", markup=False, highlight=False)
        elif zoo.list_keys(prefix):  # half-written or half-deleted: `zoo ls` warns about it
            records.delete_record(zoo, model_id)
            console.print(f"removed partial record {model_id}", markup=False, highlight=False)
        else:
            missing.append(model_id)
    if missing:
        raise UsageError(f"no zoo model(s) {missing} in {zoo.describe()}; `kiln zoo ls` lists them")
    return EXIT_OK


def _cmd_zoo_query(args: argparse.Namespace, console: Console) -> int:
    from kiln import models
    from kiln.warmstart import decision
    from kiln.warmstart import index as zoo_index

    jobs = _load_all([args.file])
    if len(jobs) != 1:
        raise UsageError(f"{args.file}: holds {len(jobs)} jobs; query one job at a time")
    job, zoo = jobs[0], _open_zoo(args)
    modality, task = models.modality_of(job.spec.model), models.task_of(job.spec.model)
    if job.spec.model.entrypoint is not None:  # as `kiln run` does: the job file's folder
        sys.path.insert(0, str(Path(args.file).resolve().parent))
    with zoo_index.ZooIndex(zoo) as index:
        try:
            found = index.query(decision.model_graph(job.spec.model), modality=str(modality),
                                task=str(task), top_k=None)
            chosen = decision.decide(job, zoo, zoo_index=index)
        except models.EntrypointError as exc:
            raise UsageError(f"{args.file}: {exc}") from None
    found = dataclasses.replace(found, candidates=tuple(  # what the job's namespace sees
        c for c in found.candidates if c.record.visible_to(job.namespace)))
    reason = chosen.reason[:1].upper() + chosen.reason[1:]
    # A candidate, not yet a parent: the trainer's guard may still refuse it.
    guard = (f"the trainer warm-starts from {chosen.parent} only if its guard accepts it "
             f"(step-0 probe, else {job.spec.warm_start.probe_steps} training steps beside a "
             "cold start); else it tries the alternatives, then starts cold"
             if chosen.parent is not None else "")
    if args.output != "table":
        output.show(console, args.output, {
            "job": job.name, "zoo_models": len(index), "search": str(found.mode),
            "candidate": chosen.parent, "alternatives": list(chosen.alternatives),
            "reason": reason, "guard": guard or None,
            "candidates": [{"rank": rank, "id": cand.id, "architecture": cand.record.builder,
                            "similarity": cand.similarity,
                            "metric_name": cand.record.metric_name,
                            "metric_value": cand.record.metric_value}
                           for rank, cand in enumerate(found.candidates[:args.top], start=1)]})
        return EXIT_OK
    output.print_table(console, tables.warm_start_candidates(job, found, len(index),
                                                             chosen.parent, top=args.top))
    console.print(reason, markup=False, highlight=False)
    if guard:
        console.print(guard[:1].upper() + guard[1:] + ".", markup=False, highlight=False)
    return EXIT_OK


def _cmd_zoo_import(args: argparse.Namespace, console: Console) -> int:
    from kiln import models
    from kiln.warmstart import graph, pretrained

    if (args.weights / records.META_NAME).is_file():  # a `kiln zoo export` folder
        return _import_export(args, console)
    if args.metric is None:
        raise UsageError("--metric: required for weights without a zoo record, e.g. "
                         "--metric validation_accuracy=0.91")
    try:
        metric = pretrained.parse_metric(args.metric)
    except pretrained.WeightsError as exc:
        raise UsageError(str(exc)) from None
    spec, folder = _import_model_spec(args)
    zoo = _open_zoo(args)
    sys.path[:0] = [folder]  # the entrypoint's package, as `kiln run` gives trainers
    try:
        rec = pretrained.import_weights(zoo, args.weights, spec, metric=metric,
                                        source=args.source, license_text=args.license,
                                        dataset=args.dataset, namespace=args.namespace,
                                        share=api.ZooShare(args.share))
    except (models.EntrypointError, graph.GraphError, TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None  # WeightsError is a ValueError
    finally:
        sys.path.remove(folder)
    console.print(f"imported {rec.id}: {rec.builder}, {rec.num_params:,} parameters, "
                  f"{rec.metric_name} {rec.metric_value:g}, from {rec.source}",
                  markup=False, highlight=False)
    console.print(f"jobs warm-start from it by similarity, or pin it: spec.warmStart.parent: "
                  f"{rec.id}", markup=False, highlight=False)
    return EXIT_OK


def _import_model_spec(args: argparse.Namespace) -> tuple[api.ModelSpec, str]:
    """`kiln zoo import`'s model, from --job or the model flags, and the folder of its code."""
    flags = {"--entrypoint": args.entrypoint, "--architecture": args.architecture,
             "--input-shape": args.input_shape, "--task": args.task}
    if args.job is not None:
        given = [name for name, value in flags.items() if value is not None]
        if given or args.args != "{}":
            drop = ", ".join(given or ["--args"])
            raise UsageError(f"--job {args.job} gives the model; drop {drop}")
        jobs = _load_all([args.job])
        if len(jobs) != 1:
            raise UsageError(f"--job {args.job}: holds {len(jobs)} jobs; give a file with one")
        return jobs[0].spec.model, str(args.job.resolve().parent)
    if (args.entrypoint is None) == (args.architecture is None):
        raise UsageError("give the model: --entrypoint MODULE:CALLABLE or --architecture NAME "
                         "(one of them), or --job FILE")
    if args.input_shape is None:
        raise UsageError("--input-shape: required with --entrypoint/--architecture, e.g. 64 or "
                         "3,32,32")
    try:
        model_args = json.loads(args.args)
        shape = [int(d) for d in args.input_shape.split(",")]
    except json.JSONDecodeError as exc:
        raise UsageError(f"--args {args.args!r}: not JSON ({exc})") from None
    except ValueError:
        raise UsageError(f"--input-shape {args.input_shape!r}: expected sizes separated by "
                         "commas, e.g. 3,32,32") from None
    if not isinstance(model_args, dict):
        raise UsageError(f"--args {args.args!r}: expected a JSON object, e.g. "
                         '{"num_classes": 10}')
    wire = {"architecture": args.architecture, "entrypoint": args.entrypoint,
            "args": model_args, "inputShape": shape, "task": args.task}
    try:
        spec = api.ModelSpec.model_validate({k: v for k, v in wire.items() if v is not None})
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise UsageError(f"the model flags: {problems}") from None
    return spec, os.getcwd()


def _import_export(args: argparse.Namespace, console: Console) -> int:
    """`kiln zoo import DIR` for a `kiln zoo export` folder: the record as it was exported."""
    from kiln.warmstart import pretrained
    from kiln.zoo import export

    given = [flag for flag, value in (
        ("--job", args.job), ("--entrypoint", args.entrypoint),
        ("--architecture", args.architecture), ("--input-shape", args.input_shape),
        ("--task", args.task), ("--metric", args.metric), ("--source", args.source),
        ("--license", args.license)) if value is not None]
    if given:
        raise UsageError(f"{args.weights} is a `kiln zoo export` folder: its meta.json gives "
                         f"the model and its metrics; drop {', '.join(given)}")
    zoo = _open_zoo(args)
    try:
        rec, added = export.import_record(zoo, args.weights, check=pretrained.check_export)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not added:
        console.print(f"{rec.id} is already in the zoo with the same weights (sha256 "
                      f"{rec.weights_sha256}): nothing to import", markup=False, highlight=False)
        return EXIT_OK
    console.print(f"imported {rec.id}: {rec.builder}, {rec.num_params:,} parameters, "
                  f"{rec.metric_name} {rec.metric_value:g}, weights sha256 "
                  f"{rec.weights_sha256}", markup=False, highlight=False)
    return EXIT_OK


def _cmd_zoo_export(args: argparse.Namespace, console: Console) -> int:
    from kiln.zoo import export

    model_id = _model_id(args.model_id)
    zoo = _open_zoo(args)
    try:
        rec = export.export_record(zoo, model_id, args.out, merge=_merge_adapter)
    except store.ObjectNotFound:
        raise UsageError(f"no zoo model {args.model_id!r} in {zoo.describe()}; "
                         "`kiln zoo ls` lists them") from None
    except ValueError as exc:  # CorruptRecord too
        raise UsageError(str(exc)) from None
    console.print(f"exported {rec.id} to {args.out} ({', '.join(export.FILES)}, "
                  f"{export.README_NAME})", markup=False, highlight=False)
    return EXIT_OK


def _merge_adapter(record: records.ZooRecord, adapter: dict[str, Any],
                   base: dict[str, Any]) -> dict[str, Any]:
    """`kiln zoo export` of a LoRA adapter: its base's weights with the adapter merged in."""
    from kiln import models
    from kiln.models import lora

    spec = api.TrainingJobSpec.model_validate(record.job_spec)  # the LoRA job's: its base's model
    if record.adapter is None:
        raise ValueError("the record holds no adapter settings")
    model = models.build(spec.model)
    return lora.merged(model, base, adapter, api.PeftSpec.model_validate(record.adapter))


def _trained_epochs(zoo: store.ObjectStore,
                    family: Iterable[records.ZooRecord]) -> dict[str, int]:
    """Epochs each provisional record had trained when written (its history's last
    evaluation): its job may have been pruned or stopped long before its planned epochs."""
    from kiln.zoo import lineage

    trained: dict[str, int] = {}
    for rec in family:
        if rec.provisional:
            with contextlib.suppress(store.ObjectNotFound, store.StoreUnavailable):
                epochs = lineage.trained_epochs(records.read_history(zoo, rec))
                if epochs is not None:
                    trained[rec.id] = epochs
    return trained


def _cmd_zoo_lineage(args: argparse.Namespace, console: Console) -> int:
    from rich.text import Text
    from rich.tree import Tree

    from kiln.zoo import lineage

    model_id = _model_id(args.model_id)
    zoo = _open_zoo(args)
    listed = records.list_records(zoo)
    relatives = lineage.family(listed, model_id)
    try:
        found = lineage.lineage(listed, model_id, trained=_trained_epochs(
            zoo, [r for r in listed if r.id in relatives]))
    except KeyError:
        if zoo.list_keys(records.record_prefix(model_id)):  # there, but skipped as unusable
            raise UsageError(f"zoo record {model_id} in {zoo.describe()} is unusable (the "
                             "warning above says why), so it has no lineage; fix it, or "
                             f"remove it with `kiln zoo rm {model_id}`") from None
        raise UsageError(f"no zoo model {args.model_id!r} in {zoo.describe()}; "
                         "`kiln zoo ls` lists them") from None
    if args.output != "table":
        output.show(console, args.output, found.to_json())
        return EXIT_OK

    def label(node: lineage.Node) -> str:
        rec = node.record
        if rec is None:
            return f"{node.record_id} (no longer in the zoo)"
        text = f"{node.record_id}  {rec.builder}  {rec.metric_name} {rec.metric_value:.4g}"
        if rec.parent is None:
            text += "  cold"
        elif node.similarity is not None:
            text += f"  similarity {node.similarity:.2f}"
        if node.inherited_epochs is not None:
            text += f"  saved ~{node.inherited_epochs:.1f} epochs"
        return text + ("  [provisional]" if rec.provisional else "")

    def grow(branch: Tree, node: lineage.Node) -> None:
        for child in node.children:
            grow(branch.add(Text(label(child))), child)

    root = Tree(Text(f"Lineage of {model_id} in {zoo.describe()}"))
    at = root
    for ancestor in found.ancestors:
        at = at.add(Text(label(ancestor)))
    grow(at.add(Text(label(found.tree), style="bold")), found.tree)
    console.print(root)
    for cycle in found.cycles:  # hand-edited meta.json: the tree shows each record once
        who = (f"record {cycle[0]} is its own parent" if len(cycle) == 1 else
               f"records {', '.join(cycle)} name each other as parents")
        console.print(f"warning: parent cycle {' -> '.join((*cycle, cycle[0]))}: {who} (the "
                      "'parent' field of meta.json); fix it, e.g. set one to null",
                      markup=False, highlight=False)
    console.print("saved: epochs of training a warm start inherited, estimated as similarity x "
                  "the parent's accumulated epochs", markup=False, highlight=False)
    return EXIT_OK


def _cmd_zoo_gc(args: argparse.Namespace, console: Console) -> int:
    import datetime

    from kiln.zoo import eviction

    zoo = _open_zoo(args)
    now = datetime.datetime.now(datetime.UTC)
    chosen = eviction.plan(eviction.survey(zoo, now=now,
                                           half_life_seconds=args.half_life_days * 86400.0),
                           capacity_bytes=args.capacity)
    if not args.dry_run:
        eviction.carry_out(zoo, chosen)
    unread_bytes, unread = eviction.unlisted(zoo, chosen.entries)
    verb = "would delete" if args.dry_run else "deleted"
    rows = [{"id": e.record.id, "size_bytes": e.size_bytes, "hits": e.hits,
             "value": round(e.value, 6), "value_per_gib": round(e.value_per_gib, 6),
             "created": e.record.created_time, "provisional": e.record.provisional}
            for e in chosen.evict]
    if args.output != "table":
        output.show(console, args.output, {
            "dry_run": args.dry_run, "capacity_bytes": chosen.capacity_bytes,
            "size_bytes": chosen.size_bytes, "after_bytes": chosen.after_bytes,
            "unreadable_records": unread, "unreadable_bytes": unread_bytes,
            "evicted": rows})
        return EXIT_OK
    if rows:  # a provisional record is the exception: marked, never a column of "False"
        marked = any(row["provisional"] for row in rows)
        output.show(console, "table", [
            {**{k: v for k, v in row.items() if k != "provisional"},
             **({"note": "provisional" if row["provisional"] else ""} if marked else {})}
            for row in rows])
    console.print(f"{verb} {len(rows)} of {len(chosen.entries)} models: {chosen.size_bytes:,} "
                  f"-> {chosen.after_bytes:,} bytes (capacity {chosen.capacity_bytes:,})",
                  markup=False, highlight=False)
    if unread:
        console.print(f"not counted: {unread_bytes:,} bytes of {len(unread)} unreadable "
                      f"records ({', '.join(unread)}), which gc never deletes; fix or remove "
                      "them (the warnings above say why each was skipped)",
                      markup=False, highlight=False)
    return EXIT_OK


def _size(text: str) -> int:
    from kiln.zoo import eviction

    try:
        return eviction.parse_capacity(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text})")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def _one_line(text: str) -> str:
    """A short name for a table cell (`kiln zoo import --dataset`): one line, printable."""
    if not text.strip() or re.search(r"[\x00-\x1f\x7f]", text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a non-empty name on one line, without control characters, "
            "e.g. imagenet-1k")
    return text


def _namespace(text: str) -> str:
    """A Kubernetes namespace name from the command line (the zoo records' `namespace`)."""
    if len(text) > api.NAME_MAX_LENGTH or not re.match(api.NAME_PATTERN, text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace name: lowercase letters, digits and '-', at most "
            f"{api.NAME_MAX_LENGTH}, e.g. team-a")
    return text


def _cmd_models(args: argparse.Namespace, console: Console) -> int:
    rows = tables.architecture_rows()
    output.show(console, args.output, rows, output.rows_table(rows, title="Architectures"))
    return EXIT_OK


def _cmd_completion(args: argparse.Namespace, console: Console) -> int:
    # A static script (shtab): a TAB press runs no Python. Path arguments complete file names.
    import shtab

    parser = _parser()
    parsers = [parser]
    while parsers:
        for action in parsers.pop()._actions:
            if action.type is Path:
                action.complete = shtab.FILE  # type: ignore[attr-defined]
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
    sys.stdout.write(shtab.complete(parser, shell=args.shell))
    return EXIT_OK


def _write_generated(text: str, outs: Sequence[Path], notes: Console) -> None:
    """Write a generated file's `text` to every path in `outs` (folders are created), - to
    stdout; a "wrote PATH" line per file goes to `notes`."""
    for out in outs:
        if out == STDIN:
            sys.stdout.write(text)
            sys.stdout.flush()
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        notes.print(f"wrote {out}", markup=False, highlight=False)


def _generated_outs(args: argparse.Namespace, repository_copies: list[Path],
                    console: Console) -> tuple[list[Path], Console]:
    """Where `kiln crd`/`kiln dashboard` write (--out, --write's `repository_copies`, else
    stdout), and the console for notes: stderr whenever stdout carries the text."""
    outs = args.out or (repository_copies if args.write else [STDIN])
    return outs, output.stderr_console() if STDIN in outs else console


def _cmd_crd(args: argparse.Namespace, console: Console) -> int:
    from kiln import crd, reference

    chosen = [r for r in crd.RESOURCES if args.kind in (None, r.kind)]
    if args.write:  # each CRD to its own file, and the Helm chart's copy
        notes = console
        for resource in chosen:
            chart_copy = Path("helm/kiln") / resource.file
            _write_generated(crd.render(resource), [
                Path(resource.file), *([chart_copy] if chart_copy.parent.is_dir() else [])],
                notes)
    else:
        outs, notes = _generated_outs(args, [], console)
        _write_generated("---\n".join(crd.render(r) for r in chosen), outs, notes)
    schema_file = Path("docs/reference/zoo-record.schema.json")
    if args.write and schema_file.parent.is_dir():  # the zoo's meta.json, for tools
        _write_generated(json.dumps(records.json_schema(), indent=2) + "\n", [schema_file],
                         notes)
    if args.reference is not None:
        pages = [(args.reference, chosen[0])]
    else:
        pages = [(reference.PAGES[r], r) for r in chosen
                 if args.write and reference.PAGES[r].is_file()]
    for page, resource in pages:
        try:
            changed = reference.update(page, resource)
        except (OSError, ValueError) as error:
            raise UsageError(str(error)) from error
        notes.print(f"{'updated' if changed else 'unchanged'}: {page}", markup=False,
                    highlight=False)
    return EXIT_OK


def _cmd_dashboard(args: argparse.Namespace, console: Console) -> int:
    outs, notes = _generated_outs(args, [dashboard.CHART_COPY], console)
    _write_generated(dashboard.render(), outs, notes)
    return EXIT_OK


# -- cluster commands: kiln.Client on the user's kubeconfig -----------------------------------


def _cluster_commands(sub: Any) -> None:
    submit = sub.add_parser("submit", help="validate a TrainingJob or TrainingSweep file and "
                            "create it on the cluster (updates one that exists, as kubectl apply)")
    submit.add_argument("file", type=Path, metavar="FILE")
    submit.set_defaults(func=_cmd_submit)
    ls = sub.add_parser("ls", help="list the cluster's jobs and sweeps: phase, epoch, ETA, "
                        "warm start, placement, accuracy")
    ls.add_argument("-A", "--all-namespaces", action="store_true",
                    help="every namespace's jobs")
    ls.set_defaults(func=_cmd_ls)
    get = sub.add_parser("get", help="one job: conditions, recent events, progress, and its "
                         "warm-start and freezing story")
    get.add_argument("name", metavar="JOB")
    get.set_defaults(func=_cmd_get)
    logs = sub.add_parser("logs", help="the trainer's log of a job (its latest attempt)")
    logs.add_argument("name", metavar="JOB")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="stream new lines until the trainer ends")
    logs.add_argument("--rank", type=int, default=0, metavar="N",
                      help="the pod of rank N of a multi-node job (default 0)")
    logs.set_defaults(func=_cmd_logs)
    wait = sub.add_parser("wait", help="wait for a job's phase; exit 0 when reached, 1 when it "
                          f"ended otherwise (Failed), {EXIT_TIMEOUT} on --timeout")
    wait.add_argument("name", metavar="JOB")
    wait.add_argument("--for", dest="phase", default=api.Phase.SUCCEEDED.value, metavar="PHASE",
                      help="the phase to wait for: Succeeded (default), Running, Failed, ...")
    wait.add_argument("--timeout", type=_timeout_seconds, default=None, metavar="SECONDS",
                      help="give up after this long; 0 checks once, as kubectl wait "
                      "(default: wait as long as it takes)")
    wait.set_defaults(func=_cmd_wait)
    delete = sub.add_parser("delete", help="delete a job or sweep (its pods go with it)")
    delete.add_argument("name", metavar="JOB")
    delete.set_defaults(func=_cmd_delete)
    for command in (submit, ls, get, logs, wait, delete):
        command.add_argument("-n", "--namespace", default=None,
                             help="the namespace (default: the context's, else default)")
        command.add_argument("--context", default=None,
                             help="the kubeconfig context (default: the current one)")
        command.add_argument("--kubeconfig", type=Path, default=None, metavar="FILE",
                             help="the kubeconfig (default: $KUBECONFIG, else ~/.kube/config)")
        if command is not logs:
            output.add_option(command)


def _timeout_seconds(text: str) -> float:
    """`kiln wait --timeout`: a finite number of seconds >= 0 (0: check once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {text})")
    return value


def _cluster(args: argparse.Namespace) -> cluster_client.Client:
    return cluster_client.Client(namespace=args.namespace, context=args.context,
                                 kubeconfig=args.kubeconfig)


def _cmd_submit(args: argparse.Namespace, console: Console) -> int:
    docs = _checked_documents(args.file)  # kiln validate's checks and messages, first
    # Runtimes are the platform team's, applied with kubectl or the chart; a user's submit
    # creates jobs and sweeps only, and says what it left.
    runtimes = [doc for doc in docs if isinstance(doc, api.runtime.AnyRuntime)]
    work = [doc for doc in docs if not isinstance(doc, api.runtime.AnyRuntime)]
    errors = output.stderr_console()
    for runtime in runtimes:
        errors.print(f"note: {runtime.kind} {runtime.metadata.name} is not created: runtimes are the "
                     f"platform's; kubectl apply -f {args.file} creates it", highlight=False)
    if not work:
        errors.print(f"[red]error:[/] {escape(str(args.file))} holds no TrainingJob or "
                     "TrainingSweep to submit", highlight=False)
        return EXIT_USAGE
    client = _cluster(args)
    rows = [client.submit(api.to_wire(doc))[0] for doc in work]
    _show_actions(console, args.output, rows)
    return EXIT_OK


def _cmd_ls(args: argparse.Namespace, console: Console) -> int:
    rows = _cluster(args).list(all_namespaces=args.all_namespaces)
    output.show(console, args.output, rows, views.summary_table(rows))
    return EXIT_OK


def _cmd_get(args: argparse.Namespace, console: Console) -> int:
    view = _cluster(args).get(args.name)
    if args.output == "table":
        console.out("\n".join(views.detail_lines(view)), highlight=False)
    else:
        output.show(console, args.output, view)
    return EXIT_OK


def _cmd_logs(args: argparse.Namespace, console: Console) -> int:
    for line in _cluster(args).logs(args.name, rank=args.rank, follow=args.follow):
        console.file.write(line + "\n")
        console.file.flush()  # -f: each line as it comes
    return EXIT_OK


def _cmd_wait(args: argparse.Namespace, console: Console) -> int:
    errors = output.stderr_console()
    try:
        view = _cluster(args).wait(args.name, phase=args.phase, timeout=args.timeout)
    except cluster_errors.WaitFailed as exc:
        errors.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        if exc.view and args.output != "table":
            output.show(console, args.output, exc.view)
        return EXIT_FAILED
    except cluster_errors.WaitTimeout as exc:
        errors.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        if args.output != "table":
            output.show(console, args.output, exc.view)
        return EXIT_TIMEOUT
    if args.output == "table":
        console.out(f"{view['name']}: {view['phase']}", highlight=False)
    else:
        output.show(console, args.output, view)
    return EXIT_OK


def _cmd_delete(args: argparse.Namespace, console: Console) -> int:
    _show_actions(console, args.output, [_cluster(args).delete(args.name)])
    return EXIT_OK


def _show_actions(console: Console, fmt: str, rows: list[dict[str, Any]]) -> None:
    """'created TrainingJob NS/NAME', one line each, or the rows as JSON/YAML."""
    if fmt != "table":
        output.show(console, fmt, rows)
        return
    for row in rows:
        console.out(f"{row['action']} {row['kind']} {row['namespace']}/{row['name']}",
                    highlight=False)


if __name__ == "__main__":  # last: every command is defined by now
    sys.exit(main())
