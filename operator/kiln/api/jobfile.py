"""Job files: read TrainingJob (and TrainingSweep, TrainingRuntime) documents from YAML, strictly.

Refuses what only hurts in job files (anchors and aliases, repeated keys) and parses each
document with `kiln.api.parse_job` (or, by its kind, `kiln.api.sweep.parse_sweep`,
`kiln.api.runtime.parse_runtime`); a job naming a runtime the file or the caller holds is
checked on it too (`runtime.parse_job_on`, a sweep's template `runtime.template_problems_on`).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import yaml

from kiln import api
from kiln.api import bounds, runtime, sweep

FILE = "file"  # the kind an error names when no document could be read: no job, no sweep yet


def load_jobs(path: str | Path) -> list[api.TrainingJob]:
    """Read every TrainingJob document of a YAML file.

    YAML is read as `yaml.safe_load` reads it, except that anchors, aliases and repeated
    mapping keys are refused (see `_JobLoader`).

    Raises:
        InvalidSpec: the file is missing, unreadable, not YAML, empty, uses anchors or aliases,
            repeats a key, or a document is invalid.
    """
    return parse_jobs(_read(path), source=str(path))


Document = api.TrainingJob | sweep.TrainingSweep | runtime.AnyRuntime


def load_documents(path: str | Path) -> list[api.TrainingJob | sweep.TrainingSweep]:
    """Every TrainingJob and TrainingSweep document of a YAML file, in order, each parsed as its
    kind says, read as `load_jobs` reads; a runtime document there is used (`parse_all`), not
    returned.

    Raises:
        InvalidSpec: as `load_jobs`; a sweep's with kind TrainingSweep.
    """
    return parse_documents(_read(path), source=str(path))


def parse_documents(text: str, *, source: str) -> list[api.TrainingJob | sweep.TrainingSweep]:
    """Every TrainingJob and TrainingSweep document of YAML `text`, as `load_documents` reads.

    Raises:
        InvalidSpec: as `parse_all`.
    """
    return [d for d in parse_all(text, source=source)
            if isinstance(d, (api.TrainingJob, sweep.TrainingSweep))]


def load_all(path: str | Path, *, runtimes: typing.Sequence[runtime.AnyRuntime] = ()
             ) -> list[Document]:
    """Every document of a YAML file, runtimes included, as `parse_all` reads them."""
    return parse_all(_read(path), source=str(path), runtimes=runtimes)


def load_runtimes(path: str | Path) -> list[runtime.AnyRuntime]:
    """The runtime documents of a YAML file (other kinds refused).

    Raises:
        InvalidSpec: as `load_jobs`, or a document that is not a runtime.
    """
    found = []
    for where, doc in _sourced(_documents(_read(path), str(path)), str(path)):
        if not runtime.is_runtime(doc):
            raise api.InvalidSpec([f"kind: expected {runtime.RUNTIME_KIND} or "
                                   f"{runtime.CLUSTER_RUNTIME_KIND} (got {doc.get('kind')!r})"
                                   if isinstance(doc, dict) else "not a mapping"], source=where)
        found.append(runtime.parse_runtime(doc, source=where))
    return found


def parse_all(text: str, *, source: str,
              runtimes: typing.Sequence[runtime.AnyRuntime] = ()) -> list[Document]:
    """Every TrainingJob, TrainingSweep and (Cluster)TrainingRuntime document of YAML `text`,
    in order. A job whose spec.runtimeRef names a runtime of `text` or of `runtimes` is checked
    on it; one naming neither is checked as written.

    Raises:
        InvalidSpec: as `parse_jobs`; a job on a runtime: the fields it sets that the runtime
            locks, and its merged template's problems.
    """
    docs = _sourced(_documents(text, source), source)
    own = {where: runtime.parse_runtime(d, source=where) for where, d in docs
           if runtime.is_runtime(d)}
    known = [*runtimes, *own.values()]
    found: list[Document] = []
    for where, d in docs:
        if where in own:
            found.append(own[where])
            continue
        if sweep.is_sweep(d):
            parsed = sweep.parse_sweep(d, source=where)
            named = runtime.find(parsed.spec.template.runtime_ref, known,
                                 parsed.metadata.namespace)
            on_it = runtime.template_problems_on(api.to_wire(parsed.spec.template),
                                                 runtime.record(named), parsed.name) \
                if named else []
            if on_it:  # every trial would be refused at admission
                raise api.InvalidSpec(on_it, source=where, kind=sweep.SWEEP_KIND)
            found.append(parsed)
            continue
        kind = d.get("kind") if isinstance(d, dict) else None
        if isinstance(kind, str) and kind != api.KIND:  # its other fields would be a job's
            raise api.InvalidSpec([(f"kind: must be {api.KIND} or {sweep.SWEEP_KIND} (or "
                                    f"{runtime.RUNTIME_KIND} / {runtime.CLUSTER_RUNTIME_KIND}) "
                                    f"(got {kind!r})")], source=where, kind="document")
        meta = d.get("metadata") if isinstance(d, dict) else None
        named = runtime.find(runtime.ref_of(d), known,
                             meta.get("namespace") if isinstance(meta, dict) else None)
        found.append(runtime.parse_job_on(d, runtime.record(named), source=where) if named
                     else api.parse_job(d, source=where))
    return found


def _read(path: str | Path) -> str:
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise api.InvalidSpec([f"cannot read the file: {exc.strerror or exc}"],
                              source=str(path), kind=FILE) from None
    except UnicodeDecodeError:
        raise api.InvalidSpec(["the file is not UTF-8 text"], source=str(path),
                              kind=FILE) from None


def parse_jobs(text: str, *, source: str) -> list[api.TrainingJob]:
    """Every TrainingJob document of YAML `text` (a file's, or stdin's), as `load_jobs` reads.

    Args:
        text: YAML (or JSON) with one or more documents.
        source: where it came from, named in errors ("job.yaml", "<stdin>").

    Raises:
        InvalidSpec: as `load_jobs`, except for reading the file.
    """
    jobs = []
    for where, doc in _sourced(_documents(text, source), source):
        if sweep.is_sweep(doc):
            raise api.InvalidSpec([(f"kind: {sweep.SWEEP_KIND} is a search over jobs, not a job; "
                                   "run it with `kiln sweep run`")], source=where)
        jobs.append(api.parse_job(doc, source=where))
    return jobs


def _documents(text: str, source: str) -> list[Any]:
    """The non-empty documents of YAML `text`, decoded by `_JobLoader`.

    Raises:
        InvalidSpec: not YAML, anchors or aliases, repeated keys, too deep, or no document.
    """
    try:
        docs = [d for d in yaml.load_all(text, Loader=_JobLoader) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        if isinstance(exc, _UnsupportedYaml):  # its problem names the place itself
            raise api.InvalidSpec([problem], source=source, kind=FILE) from None
        raise api.InvalidSpec([f"not valid YAML{where}: {problem}"], source=source,
                              kind=FILE) from None
    if not docs:
        raise api.InvalidSpec(["the file holds no YAML document"], source=source, kind=FILE)
    return docs


def _sourced(docs: list[Any], source: str) -> list[tuple[str, Any]]:
    """Each document with where it came from: `source`, indexed when the file holds several."""
    return [(source + (f"[{i}]" if len(docs) > 1 else ""), d) for i, d in enumerate(docs)]


class _UnsupportedYaml(yaml.MarkedYAMLError):  # type: ignore[misc]
    """Valid YAML that job files may not use (anchors, aliases, repeated keys)."""


class _JobLoader(yaml.SafeLoader):  # type: ignore[misc]
    """`yaml.safe_load` for job files, minus what only hurts there.

    Floats follow YAML 1.2, as Kubernetes reads manifests: ``1e-5`` is a number, not the string
    YAML 1.1 makes of it (a learning rate written so would pass `kubectl apply` and fail here).
    Anchors and aliases are refused: a few lines of nested aliases expand to billions of nodes
    (the "billion laughs"), and a self-referencing one (``a: &a [*a]``) builds a cycle. Repeated
    mapping keys are refused too, as ``kubectl apply`` (strict field validation) refuses them,
    instead of the last one silently winning. Composing stops at `api.MAX_DEPTH` levels (the
    composer recurses per level), naming the field.
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._path: list[str | int] = []  # the keys down to the node being composed

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = event.start_mark
            raise _UnsupportedYaml(
                problem=f"YAML anchors and aliases are not supported in job files (line "
                f"{mark.line + 1}, column {mark.column + 1}); write the values out",
                problem_mark=mark)
        if parent is None:
            return super().compose_node(parent, index)
        # The composer recurses once per level: stop at the bound `api.parse_job` enforces,
        # naming the field, before the interpreter's stack runs out.
        self._path.append(index if isinstance(index, int) else str(
            getattr(index, "value", "?")))
        try:
            if (isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent)
                    and len(self._path) >= api.MAX_DEPTH):
                mark = event.start_mark
                raise _UnsupportedYaml(problem=bounds.too_deep(
                    tuple(self._path), f" (line {mark.line + 1})"), problem_mark=mark)
            return super().compose_node(parent, index)
        finally:
            self._path.pop()

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, typing.Hashable):
                    continue  # SafeConstructor reports unhashable keys itself
                if key in first_line:
                    raise _UnsupportedYaml(
                        problem=f"duplicate key {key!r} at line {key_node.start_mark.line + 1} "
                        f"(first at line {first_line[key]}); keep one of them",
                        problem_mark=key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's float syntax: an exponent needs no dot ("1e-5"), and JSON's numbers are floats.
_JobLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))
