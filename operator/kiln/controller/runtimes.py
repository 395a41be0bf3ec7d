"""A job's spec.runtimeRef, resolved once at admission and recorded in status.runtime.

The job then runs on that record (`api.running_doc` merges its spec.template over it), so a
later edit or deletion of the runtime never changes an admitted job.
"""

from __future__ import annotations

from kiln import api
from kiln.controller import jobs, kube, lifecycle

R = api.Reason


def path(ref: api.RuntimeRef, namespace: str) -> str:
    """The API path of the runtime `ref` names for a job of `namespace`."""
    prefix = f"/apis/{api.GROUP}/{api.VERSION}"
    if ref.kind == api.runtime.CLUSTER_RUNTIME_KIND:
        return f"{prefix}/{api.runtime.CLUSTER_RUNTIME_PLURAL}/{ref.name}"
    return f"{prefix}/namespaces/{namespace}/{api.runtime.RUNTIME_PLURAL}/{ref.name}"


async def resolve(deps: lifecycle.Deps, body: kube.Object
                  ) -> tuple[kube.Object, api.Reason | None, list[str]]:
    """`body` with the runtime its spec.runtimeRef names recorded in status.runtime (also
    written to the job), or why it cannot run: (body, reason, problems).

    Nothing to do without a runtimeRef, or once status.runtime is recorded (a repeated
    admission keeps what the first resolved). The runtime missing: RuntimeNotFound. The
    runtime invalid, or the job setting a template key the runtime locks: InvalidSpec, each
    problem naming the field.
    """
    spec = body.get("spec") or {}
    st = body.get("status") or {}
    ref = api.runtime.ref_of(body)
    if ref is None or isinstance(st.get(api.runtime.RUNTIME_STATUS), dict):
        return body, None, []  # an invalid runtimeRef: admission's validation names it
    job = jobs.JobRef.of(body)
    found = await deps.client.get(path(ref, job.namespace))
    if found is None:
        where = "" if ref.kind == api.runtime.CLUSTER_RUNTIME_KIND else \
            f" in namespace {job.namespace}"
        plural = (api.runtime.CLUSTER_RUNTIME_PLURAL
                  if ref.kind == api.runtime.CLUSTER_RUNTIME_KIND else api.runtime.RUNTIME_PLURAL)
        return body, R.RUNTIME_NOT_FOUND, [
            (f"spec.runtimeRef: {ref.kind} {ref.name!r} not found{where}; create it or name "
            f"another (kubectl get {plural})")]
    try:
        runtime = api.runtime.parse_runtime(found, source=ref.name)
    except api.InvalidSpec as exc:
        return body, R.INVALID_SPEC, [f"spec.runtimeRef: the runtime is invalid: {p}"
                                      for p in exc.problems]
    recorded = api.runtime.record(runtime)
    template = spec.get("template")
    locked = api.runtime.lock_problems(template if isinstance(template, dict) else {}, recorded)
    if locked:
        return body, R.INVALID_SPEC, locked
    async with deps.jobs.edit(job) as e:
        if lifecycle.deleting(e.body):
            return body, None, []
        recorded = e.status.setdefault(api.runtime.RUNTIME_STATUS, recorded)
    return {**body, "status": {**st, api.runtime.RUNTIME_STATUS: recorded}}, None, []
