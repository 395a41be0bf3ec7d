"""The `kiln` command: run jobs locally, validate job files, inspect the zoo, write the CRD.

Every user error is one message on stderr and a non-zero exit, never a traceback. Text from
users, zoo records and the trainer is printed as plain text, never as rich markup (a "[/]" in
a message would otherwise crash rich or restyle the output).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pydantic
from rich.console import Console
from rich.markup import escape

from kiln import api, contract, dashboard, models
from kiln.api import jobfile
from kiln.controller import main as controller_main
from kiln.local import machine, runner, runplan, tables
from kiln.placement import profile, profilecache, types
from kiln.warmstart import decision, graph, pretrained
from kiln.warmstart import index as zoo_index
from kiln.zoo import records, store

DEFAULT_ZOO = ".kiln/zoo"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


class UsageError(Exception):
    """A user mistake in arguments or files: printed as one message, exit 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kiln` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["operator"]:  # the operator owns its flags (kiln.controller.settings)
        return controller_main.main(argv[1:], prog="kiln operator")
    parser = _parser()
    args = parser.parse_args(argv)
    console = Console(stderr=False)
    if not console.is_terminal:
        console = Console(stderr=False, width=140)  # logs and pipes: keep tables readable
    errors = Console(stderr=True)
    warnings.showwarning = functools.partial(_show_warning, errors)
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, functools.partial(_stop_on_sigterm, terminated))
    try:
        code: int = args.func(args, console)
        return code
    except (UsageError, api.InvalidSpec, store.StoreUnavailable, store.StoreMisconfigured,
            runner.JobBusy, profilecache.ProfileCacheError) as exc:
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
    run.set_defaults(func=_cmd_run)

    prof = sub.add_parser("profile", help="time one training step per config (for the planner)")
    prof.add_argument("file", type=Path, metavar="FILE")
    prof.add_argument("--configs", type=_configs, default=None, metavar="P:K,...",
                      help="configs to time, e.g. single:1,ddp:2 (default: every config that "
                      "can run here)")
    prof.add_argument("--cache", type=Path, default=profilecache.DEFAULT_CACHE, metavar="PATH",
                      help=f"profile cache (default {profilecache.DEFAULT_CACHE})")
    prof.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    prof.add_argument("--refresh", action="store_true", help="measure again even when cached")
    prof.set_defaults(func=_cmd_profile)

    validate = sub.add_parser("validate", help="check job files (exit 2 when invalid)")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")
    validate.set_defaults(func=_cmd_validate)

    zoo = sub.add_parser("zoo", help="inspect the model zoo")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True, metavar="ACTION")
    ls = zoo_sub.add_parser("ls", help="list models")
    _zoo_options(ls)
    ls.set_defaults(func=_cmd_zoo_ls)
    show = zoo_sub.add_parser("show", help="show one model's record")
    show.add_argument("model_id", metavar="ID")
    _zoo_options(show)
    show.set_defaults(func=_cmd_zoo_show)
    rm = zoo_sub.add_parser("rm", help="delete models (also half-written ones)")
    rm.add_argument("model_ids", nargs="+", metavar="ID")
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
    imp.add_argument("--metric", required=True, metavar="NAME=VALUE",
                     help="what the weights were evaluated at, e.g. validation_accuracy=0.91")
    imp.add_argument("--source", default=None, metavar="TEXT",
                     help="where the weights came from, e.g. a URL (default: the path)")
    imp.add_argument("--license", default=None, metavar="TEXT", help="the weights' license")
    imp.add_argument("--dataset", default="imported", metavar="NAME",
                     help="what they were trained on (informational)")
    _zoo_options(imp)
    imp.set_defaults(func=_cmd_zoo_import)

    query = zoo_sub.add_parser("query", help="rank the zoo models a job would warm-start from")
    query.add_argument("file", type=Path, metavar="FILE")
    query.add_argument("--top", type=_positive_int, default=5, metavar="K",
                       help="how many candidates to show (default 5)")
    _zoo_options(query)
    query.set_defaults(func=_cmd_zoo_query)

    models_cmd = sub.add_parser("models", help="list registered architectures")
    models_cmd.set_defaults(func=_cmd_models)

    sub.add_parser("operator", add_help=False,
                   help="run the operator against a Kubernetes API server (see --help)")

    crd_cmd = sub.add_parser("crd", help="write the TrainingJob CRD generated from kiln.api")
    crd_cmd.add_argument("--out", action="append", type=Path, metavar="PATH",
                         help="output file (repeatable; default crds/trainingjob.yaml and, "
                              "where it exists, the Helm chart's helm/kiln/crds/ copy)")
    crd_cmd.add_argument("--reference", type=Path, metavar="PATH",
                         help="the field reference page to regenerate (default, without --out: "
                              "docs/reference/trainingjob.md where it exists)")
    crd_cmd.set_defaults(func=_cmd_crd)

    dash = sub.add_parser("dashboard", help="write the Grafana dashboard from kiln.dashboard")
    dash.add_argument("--out", action="append", type=Path, metavar="PATH",
                      help=f"output file (repeatable; default {dashboard.CHART_COPY})")
    dash.set_defaults(func=_cmd_dashboard)
    return parser


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


def _open_zoo(args: argparse.Namespace) -> store.ObjectStore:
    os.environ.update(_zoo_env(args))
    try:
        return store.open_store(args.zoo)
    except ValueError as exc:
        raise UsageError(f"--zoo {args.zoo}: {exc}") from None


def _load_all(files: Sequence[Path]) -> list[api.TrainingJob]:
    jobs, problems = [], []
    for path in files:
        try:
            for job in jobfile.load_jobs(path):
                more = models.check_job(job)
                if more:
                    raise api.InvalidSpec(more, source=str(path))
                jobs.append(job)
        except api.InvalidSpec as exc:  # a document that did not parse: add what can be told
            problems.append(str(api.InvalidSpec(models.check_job(exc), source=exc.source)))
    names = [j.name for j in jobs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"metadata.name: each job needs its own name; repeated: {duplicates}")
    if problems:
        raise UsageError("\n".join(problems))
    return jobs


def _cmd_validate(args: argparse.Namespace, console: Console) -> int:
    invalid, names = [], []
    for path in args.files:  # each file on its own: the valid ones are said valid too
        try:
            jobs = _load_all([path])
        except UsageError as exc:
            invalid.append(str(exc))
            continue
        for job in jobs:
            names.append(job.name)
            console.print(f"[green]valid[/]: {escape(job.name)} "
                          f"({escape(job.spec.model.label)} on {job.spec.dataset.source})")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        invalid.append(f"metadata.name: each job needs its own name; repeated: {repeated}")
    if invalid:
        raise UsageError("\n".join(invalid))
    return EXIT_OK


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    jobs = _load_all(args.files)
    for job in jobs:
        path = job.spec.dataset.path
        if path and not path.startswith("s3://") and not Path(path).exists():
            raise UsageError(f"{job.name}: spec.dataset.path: {path} does not exist here; point it "
                             "at the data (paths are relative to the current directory)")
    zoo = _open_zoo(args)  # fail fast on a bad zoo before any training starts
    _check_pinned_parents(jobs, zoo)
    work_dir = runner.default_work_dir()
    python_path = runner.python_path(args.files, os.environ)  # entrypoints beside job files
    try:
        machine.check_slots(args.slots)
        devices = machine.local_devices(args.slots) if len(jobs) > 1 and args.slots != 1 else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if devices is None or devices.count < 2:  # one job or one device: in file order
        outcomes = runner.run_jobs(jobs, zoo_uri=args.zoo, work_dir=work_dir, console=console,
                                  env={**_zoo_env(args), **python_path})
    else:
        profiled = runplan.profile_jobs(jobs, devices=devices, zoo_uri=args.zoo,
                                        work_dir=work_dir, console=console,
                                        profile_cache=args.profile_cache,
                                        env={**_zoo_env(args), **python_path})
        try:
            the_plan, configs = runplan.make_plan(jobs, devices=devices, zoo=zoo,
                                                  profile_cache=args.profile_cache,
                                                  profiled=profiled)
        except types.Unplaceable as exc:
            raise UsageError(f"{exc}; this machine has {devices.count} {devices.noun} "
                             "(--slots)") from None
        console.print(tables.plan(the_plan, configs, devices))  # before anything starts
        outcomes = runplan.run_planned(jobs, the_plan=the_plan, configs=configs,
                                       devices=devices, zoo_uri=args.zoo, work_dir=work_dir,
                                       console=console, env={**_zoo_env(args), **python_path},
                                       profiled=profiled)
    console.print(tables.results(outcomes))
    return EXIT_OK


def _cmd_profile(args: argparse.Namespace, console: Console) -> int:
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
    console.print(tables.profile_table(job, measured, kind=profile.device_type(args.device),
                                       cache=args.cache))
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
    problems = []
    for job in jobs:
        warm = job.spec.warm_start
        if warm.enabled and warm.parent != "auto":
            try:
                decision.pinned_record(zoo, warm.parent)
            except api.InvalidSpec as exc:
                problems += [f"{job.name}: {problem}" for problem in exc.problems]
    if problems:
        raise UsageError("\n".join(problems))


def _cmd_zoo_ls(args: argparse.Namespace, console: Console) -> int:
    zoo = _open_zoo(args)
    console.print(tables.zoo_models(zoo.describe(), records.list_records(zoo)))
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
    console.print_json(json.dumps(json.loads(rec.to_json())))
    return EXIT_OK


def _cmd_zoo_rm(args: argparse.Namespace, console: Console) -> int:
    model_ids = [_model_id(text) for text in args.model_ids]  # all checked before any delete
    zoo = _open_zoo(args)
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
    console.print(tables.warm_start_candidates(job, found, len(index), chosen.parent_id,
                                               top=args.top))
    console.print(chosen.reason[:1].upper() + chosen.reason[1:], markup=False,
                  highlight=False)
    return EXIT_OK


def _cmd_zoo_import(args: argparse.Namespace, console: Console) -> int:
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
                                        dataset=args.dataset)
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def _cmd_models(args: argparse.Namespace, console: Console) -> int:
    console.print(tables.architectures())
    return EXIT_OK


def _write_generated(text: str, outs: Sequence[Path], console: Console) -> None:
    """Write a generated file's `text` to every path in `outs` (folders are created)."""
    for out in outs:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        console.print(f"wrote {out}", markup=False)


def _cmd_crd(args: argparse.Namespace, console: Console) -> int:
    from kiln import crd, reference

    chart_copy = Path("helm/kiln/crds/trainingjob.yaml")
    _write_generated(crd.render(), args.out or [
        Path("crds/trainingjob.yaml"), *([chart_copy] if chart_copy.parent.is_dir() else [])],
        console)
    page = args.reference
    if page is None and args.out is None and reference.PAGE.is_file():
        page = reference.PAGE
    if page is not None:
        try:
            changed = reference.update(page)
        except (OSError, ValueError) as error:
            raise UsageError(str(error)) from error
        console.print(f"{'updated' if changed else 'unchanged'}: {page}", markup=False)
    return EXIT_OK


def _cmd_dashboard(args: argparse.Namespace, console: Console) -> int:
    _write_generated(dashboard.render(), args.out or [dashboard.CHART_COPY], console)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
