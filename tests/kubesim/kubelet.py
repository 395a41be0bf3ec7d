"""A test kubelet: runs the emulator's pods as local processes and reports their status.

Does for a trainer pod what a scheduler and a kubelet would, over the emulator's HTTP API (so
the operator sees every change through its watch), injects faults (`Fault`), holds a pod's
process where a test needs it (`Hold`) and can run pods slower (`pause.Throttle`). No images
(but unpullable ones), resource limits or probes; volumes only as a stand-in (`Kubelet`,
mounts).
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trainerproc

from kiln import contract
from kiln.local import zygote
from kubesim import client, informer, pause, torchrun

KUBELET_USER_AGENT = "kubesim-kubelet"
# How often the pods that run here are looked at (their processes, deadlines, faults, holds);
# a change of a pod in the API wakes the kubelet at once.
POLL_SECONDS = 0.1
LOG_TAIL_LINES = 80
LOG_TAIL_BYTES = 2048
JOB_NAME_LABEL = "kiln.dev/job-name"
ATTEMPT_LABEL = "kiln.dev/attempt"
# An image whose name contains this is never pulled (see `Kubelet`).
UNPULLABLE = "unpullable"
# A real kubelet reports ErrImagePull on each failed pull and ImagePullBackOff while it waits
# to try again; here each cycle of PULL_CYCLE_SECONDS starts with PULL_ERROR_SECONDS of the
# former (short: a test sees several cycles before a short start timeout).
PULL_CYCLE_SECONDS = 1.5
PULL_ERROR_SECONDS = 0.5
HELD = "held"  # the `pause.Gate` reason of a `Hold`
METRICS_READ_SECONDS = 5.0


@dataclasses.dataclass
class Fault:
    """Kill a job's trainer: the first time `when(pod)` holds, send `signal`.

    Attributes:
        job: the TrainingJob name (kiln.dev/job-name label).
        signal: the signal (SIGKILL: exit code 137).
        attempts: which attempts to hit (None: every attempt).
        when: checked about every `check_every_seconds` while the pod runs.
        container_reason: the terminated reason to report ("Error", or "OOMKilled").
        check_every_seconds: how often `when` is evaluated.
        hits: pods killed so far (filled by the kubelet).
    """

    job: str
    signal: int = signal.SIGKILL
    attempts: frozenset[int] | None = None
    when: Callable[[RunningPod], bool] = lambda _pod: True
    container_reason: str = "Error"
    check_every_seconds: float = 0.5
    hits: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Hold:
    """Keep one pod's process stopped (SIGSTOP to its process group) from the first check at
    which `when(pod)` holds until `release()`: a trainer that has not got further yet, on a
    machine of any speed. Add it before the pod starts (`Kubelet.hold`).

    While held, the pod's metrics endpoint (its prometheus.io/port) answers with the
    exposition read just before the stop, as a trainer between two steps would (the kubelet
    serves it: the trainer's own server is stopped too). Before any signal it sends the pod
    (a deletion's or a deadline's SIGTERM, a fault), the kubelet releases the hold (SIGCONT),
    so that a trainer can checkpoint and exit.

    Attributes:
        namespace: the pod's namespace.
        pod: the pod's name.
        when: checked as the process starts (the default holds it there, before its command
            has done anything), then about every `check_every_seconds` while it runs.
        check_every_seconds: how often `when` is evaluated.
        held: set once the process is stopped.
        released: set by `release` (or by the kubelet, before it signals the pod).
        reads: `time.monotonic()` of each metrics read answered while held.
    """

    namespace: str
    pod: str
    when: Callable[[RunningPod], bool] = lambda _pod: True
    check_every_seconds: float = 0.1
    held: threading.Event = dataclasses.field(default_factory=threading.Event)
    released: threading.Event = dataclasses.field(default_factory=threading.Event)
    reads: list[float] = dataclasses.field(default_factory=list)

    def release(self) -> None:
        """Let the process go on (within a poll); a hold never applies again once released."""
        self.released.set()

    def holding(self) -> bool:
        return self.held.is_set() and not self.released.is_set()


class MetricsProxy:
    """A held pod's metrics endpoint (see `Hold`): the trainer's own answer while it runs, the
    exposition read just before the hold while it is stopped."""

    def __init__(self, trainer_port: int, hold: Hold) -> None:
        self.trainer_port = trainer_port
        self.hold = hold
        self.snapshot: bytes | None = None
        self.server = client.serve_text(self.answer, name="kubesim-metrics-proxy")
        self.port: int = self.server.server_address[1]

    def answer(self, path: str) -> tuple[int, bytes]:
        if self.hold.holding():
            if self.snapshot is None:
                return 503, b"held before its metrics server was up\n"
            self.hold.reads.append(time.monotonic())
            return 200, self.snapshot
        try:
            return 200, _read_metrics(self.trainer_port, path)
        except OSError as exc:
            return 502, f"{exc}\n".encode()

    def keep_snapshot(self) -> None:
        """Read the trainer's exposition now (call just before stopping it)."""
        try:
            self.snapshot = _read_metrics(self.trainer_port, "/metrics")
        except OSError:
            self.snapshot = None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclasses.dataclass
class RunningPod:
    """A pod whose container runs as a local process."""

    namespace: str
    name: str
    uid: str
    job: str
    attempt: int
    process: subprocess.Popen[bytes] | zygote.Process
    log_path: Path
    termination_path: Path
    metrics_port: int
    grace_seconds: float
    gate: pause.Gate
    fault: Fault | None = None
    hold: Hold | None = None
    proxy: MetricsProxy | None = None
    last_check: float = 0.0
    last_hold_check: float = 0.0
    terminating_since: float | None = None
    mounts: list[Path] = dataclasses.field(default_factory=list)
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    deadline_exceeded: bool = False

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def metrics(self) -> str:
        """The trainer's /metrics exposition now, "" while it serves none."""
        try:
            return _read_metrics(self.metrics_port, "/metrics").decode()
        except OSError:
            return ""


@dataclasses.dataclass
class HeldPod:
    """A pod whose image cannot be pulled: bound, never started, its container waiting."""

    namespace: str
    name: str
    uid: str
    container: str
    image: str
    started_at: float
    reason: str = ""


@dataclasses.dataclass
class InitRun:
    """A pod's init container running as a local process, before its container starts."""

    pod: dict[str, Any]
    index: int
    process: subprocess.Popen[bytes] | zygote.Process
    log_path: Path
    termination_path: Path
    mounts: list[Path]


class Kubelet:
    """Runs pods of the emulator in a daemon thread, as a scheduler and kubelet would, acting
    on each pod as the watch of all pods (`informer.Informer`) reports its change:

    * bind: set spec.nodeName to the node the pod's required node affinity names;
    * init containers: each runs to its end, in order, as a local process (environment,
      Secrets and mounts as below) before the container starts; the pod stays Pending with
      its initContainerStatuses meanwhile, and one that exits non-zero fails the pod (its
      terminated state with the exit code and termination message, as with
      restartPolicy Never);
    * run: start the container's command + args as a local process (its own process group) with
      the pod's environment: plain values, ``secretKeyRef`` (read from the Secret in the pod's
      namespace, as the kubelet does; an optional key it lacks leaves the variable unset), ``fieldRef`` for metadata.name/namespace and status.podIP;
      ``python`` resolves to this interpreter (its bin directory comes first on PATH); a
      container or init container the zygote runs (`kiln.local.zygote.forkable`: ``python -m
      kiln_trainer``) is forked from it, and so are the trainer workers of a ``python -m
      torch.distributed.run`` container (its agent is torch's, run by `torchrun`);
    * termination message: the trainer writes it to a scratch file (``KILN_TERMINATION_LOG``, the
      kubelet's terminationMessagePath); with ``FallbackToLogsOnError`` the log's tail is used
      when that file is empty and the exit code is not 0;
    * mounts (a test stand-in for a kubelet's mounts, without a container filesystem): each
      volumeMount of the container becomes a symlink at its mountPath to the volume's directory
      on this machine (``hostPath``: its path; ``emptyDir``: a scratch folder of the pod;
      ``persistentVolumeClaim``: a folder of the claim, shared by every pod that mounts it),
      removed when the container ends; a mountPath that already exists here is an error, and
      Kiln's /dev/shm is the machine's own. A mount whose path (or a path beneath it) an
      environment value or a command argument starts with is not linked: those values point
      into its folder instead, so pods may use the same fixed paths at once. A ``secret`` volume's keys are written as
      files under the pod's scratch folder at ``secrets/<mountPath>``, and the environment
      values naming its mountPath, or a folder above it, point there;
    * ports: every pod's IP is 127.0.0.1, so a container's metrics port is mapped to a free host
      port: ``KILN_METRICS_PORT`` is set to it and the pod's ``prometheus.io/port`` annotation is
      patched to it (what a CNI with per-pod IPs makes unnecessary);
    * DNS for a multi-node job's pods (``spec.subdomain``): in the values of torchrun's
      ``--rdzv-endpoint`` and ``--local-addr`` and of ``PET_RDZV_ENDPOINT``/``PET_LOCAL_ADDR``,
      a name ``<hostname>.<subdomain>.<namespace>.svc`` becomes 127.0.0.<1 + the hostname's
      trailing number> (loopback addresses that sort as the hostnames do, as torchrun's ranks
      need), and the rendezvous port a free host port, one per job and attempt (what cluster
      DNS and per-pod IPs do);
    * status: Running (podIP, startTime, a running container), then Succeeded/Failed with the
      container's terminated exitCode (128 + signal when killed), reason and message;
    * pods by uid, as a real kubelet: a pod deleted and created again under its name is a new
      pod, started again;
    * deletion: a pod that gets a deletionTimestamp (Terminating, `emulator.Emulator`) has its
      process sent SIGTERM, then SIGKILL after its deletionGracePeriodSeconds; once the process
      has exited, its status is reported and the pod deleted with grace 0 (uid precondition),
      which removes it. A pod that never ran here is removed at once. A pod that disappears
      without that (force-deleted) has its process stopped the same way, without a status;
    * scheduling: a pod named in `unschedulable_pods` (``namespace/name``; the test's stand-in
      for a pod whose node's free devices another scheduler took) is not bound: it stays
      Pending with PodScheduled=False/Unschedulable until it leaves that set;
    * `overlaps` records each pod started while a pod of another attempt of its job (same
      namespace, kiln.dev/job-name) still ran here: two trainers of one job at once;
    * spec.activeDeadlineSeconds (as last watched, so a patch takes effect): once the pod has
      been active that long, its process is sent SIGTERM, then SIGKILL after the grace period;
      the pod stays, Failed with status.reason DeadlineExceeded;
    * unpullable images: a pod whose container image contains ``unpullable`` is bound but never
      started; it stays Pending with the container waiting, ErrImagePull then ImagePullBackOff
      (alternating as a real kubelet's back-off does), each message naming the image;
    * holds (`Hold`): a pod's process stopped where the test wants it until released;
    * a slower machine: with `share` below 1, every pod's process group runs only that share
      of the time (`pause.Throttle`).

    Args:
        url: the emulator's base URL.
        work_dir: scratch space; each pod gets ``<namespace>/<pod>/``.
        base_env: environment every container starts from (besides PATH and HOME).
        share: the share of the time pods run; None: ``KUBESIM_TRAINER_SHARE``, else 1.
        fork_trainers: start ``python -m kiln_trainer`` pods and torchrun's trainer workers by
            forking this test process's zygote (`kiln.local.zygote`: torch imported once), other
            commands as processes of their own; None: unless ``KILN_FORK_TRAINERS=0``.
    """

    def __init__(self, url: str, work_dir: Path, *, base_env: dict[str, str] | None = None,
                 share: float | None = None, fork_trainers: bool | None = None) -> None:
        self.fork_trainers = zygote.enabled() if fork_trainers is None else fork_trainers
        self.client = client.Client(url, user_agent=KUBELET_USER_AGENT)
        self.work_dir = work_dir
        self.base_env = {"OMP_NUM_THREADS": "1", "LANG": "C.UTF-8", **(base_env or {})}
        self.faults: list[Fault] = []
        self.holds: list[Hold] = []
        self.throttle = pause.Throttle(
            pause.share_from_env(pause.TRAINER_SHARE_ENV) if share is None else share)
        self.started: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.overlaps: list[str] = []
        self.unschedulable_pods: set[str] = set()
        # by pod uid
        self._running: dict[str, RunningPod] = {}
        self._finished: dict[str, RunningPod] = {}
        self._held: dict[str, HeldPod] = {}
        self._initializing: dict[str, InitRun] = {}
        self._initialized: set[str] = set()
        self._unscheduled: set[str] = set()
        self._scratch: dict[tuple[str, str], Path] = {}  # the latest pod of each name
        # (namespace, subdomain, attempt, port) -> the host port a gang's rendezvous uses
        self._gang_ports: dict[tuple[str, str, str, str], int] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        # Pods by uid, kept by a watch: a finished pod costs nothing until it changes.
        self._pods = informer.Informer(url, client.Client.pods_path(),
                                       user_agent=KUBELET_USER_AGENT, changed=self._wake.set,
                                       errors=self.errors)
        self._pending: set[str] = set()  # uids changed in the API, not looked at yet
        self._thread = threading.Thread(target=self._main, name="kubesim-kubelet", daemon=True)
        self._lock = threading.Lock()
        self._forker: torchrun.Forker | None = None  # started by the first torchrun pod

    def start(self) -> None:
        self._pods.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and kill every process still running."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self._pods.stop()
        for pod in list(self._running.values()):
            _signal_group(pod.process, signal.SIGKILL)
            pod.process.wait(timeout=30)
            self._ended(pod)
        for init in self._initializing.values():
            _signal_group(init.process, signal.SIGKILL)
            init.process.wait(timeout=30)
            _unlink(init.mounts)
        self.throttle.stop()
        if self._forker is not None:
            self._forker.close()

    def inject(self, fault: Fault) -> Fault:
        """Add a fault; returns it (its `hits` fill in as pods are killed)."""
        with self._lock:
            self.faults.append(fault)
        return fault

    def hold(self, hold: Hold) -> Hold:
        """Add a hold for a pod yet to start; returns it (see `Hold`)."""
        with self._lock:
            self.holds.append(hold)
        return hold

    def pod_log_path(self, namespace: str, name: str) -> Path | None:
        """Where the latest pod of that name writes its container log; None when none ran."""
        scratch = self._scratch.get((namespace, name))
        return scratch / "container.log" if scratch is not None else None

    def pod_log(self, namespace: str, name: str) -> str:
        """The container log (stdout and stderr) of the latest pod of that name, "" when none
        ran."""
        scratch = self._scratch.get((namespace, name))
        path = scratch / "container.log" if scratch is not None else None
        return path.read_text(encoding="utf-8", errors="replace") if path and path.exists() \
            else ""

    # -- the loop ---------------------------------------------------------------------------

    def _main(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the sync: a change during it wakes the next one at once
            try:
                self._sync()
            except Exception as exc:  # noqa: BLE001  # reported to the test through .errors
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._wake.wait(POLL_SECONDS)

    def _sync(self) -> None:
        """Look at each pod that changed in the API, or waits here for something other than
        the API (an init container's process, a test's `unschedulable_pods`), then at each
        pod that runs or waits for its image. A pod left pending (its start failed) is looked
        at again next time."""
        listed = self._pods.objects  # read by key only: the watch's thread changes it
        self._pending |= self._pods.take_changed()
        for uid in dict.fromkeys([*self._pending, *self._initializing, *self._unscheduled]):
            pod = listed.get(uid)
            if pod is None:  # gone: what runs here for it is stopped below
                self._finished.pop(uid, None)
                self._initialized.discard(uid)
                self._unscheduled.discard(uid)
            else:
                self._look_at(uid, pod)
            self._pending.discard(uid)
        now = time.monotonic()
        for uid, running in list(self._running.items()):
            found = listed.get(uid)
            meta = (found or {}).get("metadata") or {}
            if found is None or meta.get("deletionTimestamp"):
                self._terminate(running, meta, now)
            elif running.process.poll() is not None:
                self._ended(running)
                self._report_exit(running)
                self._finished[uid] = self._running.pop(uid)
            elif running.deadline_exceeded or _past_deadline(found, running.started_at, now):
                running.deadline_exceeded = True
                _stop(running, now)
            else:
                self._apply_hold(running, now)
                self._apply_fault(running, now)
        for uid, held in list(self._held.items()):
            found = listed.get(uid)
            if found is None:
                del self._held[uid]
            elif _past_deadline(found, held.started_at, now):
                del self._held[uid]
                self._patch(client.Client.pods_path(held.namespace, held.name) + "/status", {
                    "status": {"phase": "Failed", **_DEADLINE_STATUS}})
            else:
                self._wait_for_image(held, now)
        for uid in [u for u in self._initializing if u not in listed]:  # force-deleted
            init = self._initializing.pop(uid)
            _signal_group(init.process, signal.SIGKILL)
            init.process.wait(timeout=30)
            _unlink(init.mounts)

    def _look_at(self, uid: str, pod: dict[str, Any]) -> None:
        """Start a new pod (or leave it unscheduled), step its init containers, or remove it
        once deleted when nothing of it runs here."""
        if uid in self._running:
            return
        if uid in self._initializing:
            self._step_init(uid, pod)
            return
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):  # nothing runs here to stop: remove it now
            self._held.pop(uid, None)
            self._unscheduled.discard(uid)
            self._remove(meta)
            return
        known = uid in self._finished or uid in self._held
        if known or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return
        if f"{meta.get('namespace', '')}/{meta['name']}" in self.unschedulable_pods:
            self._leave_unscheduled(uid, pod)
            return
        self._unscheduled.discard(uid)
        self._start(pod)

    def _run(self, command: list[str], env: dict[str, str], scratch: Path, log_path: Path
             ) -> subprocess.Popen[bytes] | zygote.Process:
        """Start a container's `command` in a session of its own, its output to `log_path`:
        forked from the zygote where it can be (`fork_trainers`), torchrun with its trainer
        workers forked (`torchrun.AGENT`), else as a process of its own."""
        with log_path.open("wb") as log:
            return trainerproc.start(command, env=env, cwd=scratch, stdout=log.fileno(),
                                     stderr=log.fileno(), new_session=True,
                                     fork=self.fork_trainers, forker=self._torchrun_forker)

    def _torchrun_forker(self) -> torchrun.Forker:
        """This kubelet's fork server for torchrun's workers, started by the first torchrun pod."""
        with self._lock:
            if self._forker is None:
                self._forker = torchrun.Forker()
            return self._forker

    def _leave_unscheduled(self, uid: str, pod: dict[str, Any]) -> None:
        """Report once that no node can take the pod (as the scheduler does)."""
        if uid in self._unscheduled:
            return
        self._unscheduled.add(uid)
        meta = pod["metadata"]
        node = _affinity_node(pod.get("spec") or {})
        self._patch(client.Client.pods_path(meta.get("namespace", ""), meta["name"]) + "/status",
                    {"status": {"phase": "Pending", "conditions": [{
                        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": f"0/1 nodes are available: node {node} cannot take the "
                                   "pod (kubesim unschedulable_pods)."}]}})

    def _remove(self, meta: dict[str, Any]) -> None:
        """Delete a Terminating pod with grace 0 (it runs nothing here any more): the API
        server then removes it; the uid precondition spares a new pod of the same name."""
        path = client.Client.pods_path(meta.get("namespace", ""), meta["name"])
        try:
            self.client.request("DELETE", path, {
                "apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": meta.get("uid")}})
        except client.ApiError as exc:
            if exc.status not in (404, 409):
                raise

    def _hold(self, pod: dict[str, Any], container: dict[str, Any]) -> None:
        """Bind a pod whose image cannot be pulled and report its container waiting."""
        meta, spec = pod["metadata"], pod.get("spec") or {}
        namespace, name = meta.get("namespace", ""), meta["name"]
        if not self._patch(client.Client.pods_path(namespace, name),
                           {"spec": {"nodeName": _affinity_node(spec)}}):
            return  # deleted before it could be bound
        held = HeldPod(namespace=namespace, name=name, uid=str(meta.get("uid", "")),
                       container=container["name"], image=str(container.get("image", "")),
                       started_at=time.monotonic())
        self._held[held.uid] = held
        self._wait_for_image(held, held.started_at)

    def _wait_for_image(self, held: HeldPod, now: float) -> None:
        """Report the held pod's pull error or back-off (a patch only when it changes)."""
        pulling = (now - held.started_at) % PULL_CYCLE_SECONDS < PULL_ERROR_SECONDS
        reason = "ErrImagePull" if pulling else "ImagePullBackOff"
        if reason == held.reason:
            return
        message = (f'failed to pull and unpack image "{held.image}": not found' if pulling
                   else f'Back-off pulling image "{held.image}"')
        first = not held.reason
        held.reason = reason
        status: dict[str, Any] = {
            "phase": "Pending",
            "containerStatuses": [{
                "name": held.container, "ready": False, "started": False, "restartCount": 0,
                "image": held.image,
                "state": {"waiting": {"reason": reason, "message": message}}}]}
        if first:
            status["startTime"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            status["conditions"] = [{"type": "PodScheduled", "status": "True"}]
        self._patch(client.Client.pods_path(held.namespace, held.name) + "/status",
                    {"status": status})

    def _start(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        namespace, name = meta.get("namespace", ""), meta["name"]
        labels = meta.get("labels") or {}
        container = spec["containers"][0]
        if UNPULLABLE in str(container.get("image", "")):
            self._hold(pod, container)
            return
        uid = str(meta.get("uid", ""))
        scratch = self.work_dir / namespace / name / uid
        scratch.mkdir(parents=True, exist_ok=True)
        self._scratch[(namespace, name)] = scratch
        if spec.get("initContainers") and uid not in self._initialized:
            self._start_init(pod, 0, scratch)
            return
        termination = scratch / "termination-log"
        termination.write_bytes(b"")
        port = client.free_port()
        job = str(labels.get(JOB_NAME_LABEL, ""))
        attempt = int(labels.get(ATTEMPT_LABEL, "-1"))
        with self._lock:
            fault = next((f for f in self.faults if f.job == job and (
                f.attempts is None or attempt in f.attempts)), None)
            hold = next((h for h in self.holds if (h.namespace, h.pod) == (namespace, name)
                         and not h.released.is_set()), None)
        env = {**self.base_env, **self._container_env(namespace, name, container),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "HOME": str(scratch), contract.Env.TERMINATION_LOG: str(termination)}
        proxy = None
        if contract.Env.METRICS_PORT in env:
            env[contract.Env.METRICS_PORT] = str(port)
            if hold is not None:
                proxy = MetricsProxy(port, hold)
        command = [*container.get("command", []), *container.get("args", [])]
        if spec.get("subdomain"):
            command, env = self._resolve_gang(namespace, labels, command, env)
        node = _affinity_node(spec)
        if not self._patch(client.Client.pods_path(namespace, name), {
                "spec": {"nodeName": node}, "metadata": {"annotations": {
                    "prometheus.io/port": str(proxy.port if proxy else port)}}}):
            if proxy is not None:
                proxy.stop()
            return  # deleted before it could start
        env = self._secret_volumes(namespace, name, spec, container, scratch, env)
        mounts, env, command = self._mount(namespace, spec, container, scratch, env, command)
        log_path = scratch / "container.log"
        process = self._run(command, env, scratch, log_path)
        gate = pause.Gate(process.pid)  # its process group: start_new_session
        self.throttle.add(gate)
        running = RunningPod(
            namespace=namespace, name=name, uid=uid, job=job, attempt=attempt, process=process,
            log_path=log_path, termination_path=termination, metrics_port=port,
            grace_seconds=float(spec.get("terminationGracePeriodSeconds", 30)), gate=gate,
            fault=fault, hold=hold, proxy=proxy, mounts=mounts)
        self._apply_hold(running, time.monotonic())  # a hold from the start: before it runs
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._patch(client.Client.pods_path(namespace, name) + "/status", {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1", "startTime": now,
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "True"}],
            "containerStatuses": [{
                "name": container["name"], "ready": True, "started": True, "restartCount": 0,
                "image": container.get("image", ""), "state": {"running": {"startedAt": now}},
            }]}})
        self.overlaps += [
            f"{namespace}/{name} started while {other.name} of attempt {other.attempt} ran"
            for other in self._running.values()
            if job and other.namespace == namespace and other.job == job
            and other.attempt != attempt and other.process.poll() is None]
        self._running[uid] = running
        self.started.append((namespace, name))

    def _start_init(self, pod: dict[str, Any], index: int, scratch: Path) -> None:
        """Start init container `index` of `pod` (bound to its node, Pending meanwhile)."""
        meta, spec = pod["metadata"], pod.get("spec") or {}
        namespace, name = meta.get("namespace", ""), meta["name"]
        container = spec["initContainers"][index]
        termination = scratch / f"{container['name']}.termination-log"
        termination.write_bytes(b"")
        env = {**self.base_env, **self._container_env(namespace, name, container),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "HOME": str(scratch), contract.Env.TERMINATION_LOG: str(termination)}
        status = self._init_statuses(spec, index, {"running": {"startedAt": _now()}})
        if not self._patch(client.Client.pods_path(namespace, name),
                           {"spec": {"nodeName": _affinity_node(spec)}}):
            return  # deleted before it could start
        env = self._secret_volumes(namespace, name, spec, container, scratch, env)
        mounts, env, command = self._mount(
            namespace, spec, container, scratch, env,
            [*container.get("command", []), *container.get("args", [])])
        log_path = scratch / f"{container['name']}.log"
        process = self._run(command, env, scratch, log_path)
        self._initializing[str(meta.get("uid", ""))] = InitRun(
            pod, index, process, log_path, termination, mounts)
        self._patch(client.Client.pods_path(namespace, name) + "/status", {"status": {
            "phase": "Pending", "startTime": _now(),
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Initialized", "status": "False"}],
            "initContainerStatuses": status,
            "containerStatuses": [{"name": spec["containers"][0]["name"], "ready": False,
                                   "state": {"waiting": {"reason": "PodInitializing"}}}]}})

    def _step_init(self, uid: str, pod: dict[str, Any]) -> None:
        """Poll a pod's running init container: on to the next one, or the container, once it
        exits 0; the pod Failed when it exits otherwise, or stopped when the pod is deleted."""
        init = self._initializing[uid]
        meta, spec = pod["metadata"], pod.get("spec") or {}
        if meta.get("deletionTimestamp"):
            _signal_group(init.process, signal.SIGKILL)
        code = init.process.poll()
        if code is None:
            return
        del self._initializing[uid]
        _unlink(init.mounts)
        scratch = init.log_path.parent
        if meta.get("deletionTimestamp"):
            self._remove(meta)
            return
        if code == 0 and init.index + 1 < len(spec["initContainers"]):
            self._start_init(pod, init.index + 1, scratch)
            return
        if code == 0:
            self._initialized.add(uid)
            self._start(pod)
            return
        exit_code = code if code >= 0 else 128 - code
        message = init.termination_path.read_text(encoding="utf-8", errors="replace")
        if not message.strip():  # terminationMessagePolicy FallbackToLogsOnError
            lines = init.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            message = "\n".join(lines)[-LOG_TAIL_BYTES:]
        self._patch(client.Client.pods_path(meta.get("namespace", ""), meta["name"])
                    + "/status", {"status": {
                        "phase": "Failed",
                        "conditions": [{"type": "PodScheduled", "status": "True"},
                                       {"type": "Initialized", "status": "False"}],
                        "initContainerStatuses": self._init_statuses(spec, init.index, {
                            "terminated": {"exitCode": exit_code, "reason": "Error",
                                           "message": message, "finishedAt": _now()}})}})

    @staticmethod
    def _init_statuses(spec: dict[str, Any], index: int, state: dict[str, Any]
                       ) -> list[dict[str, Any]]:
        """initContainerStatuses while init container `index` is in `state`: the ones
        before it completed, the ones after it waiting."""
        statuses = []
        for i, container in enumerate(spec["initContainers"]):
            here = (state if i == index else
                    {"terminated": {"exitCode": 0, "reason": "Completed"}} if i < index else
                    {"waiting": {"reason": "PodInitializing"}})
            statuses.append({"name": container["name"], "ready": i < index, "restartCount": 0,
                             "image": container.get("image", ""), "state": here})
        return statuses

    def _mount(self, namespace: str, spec: dict[str, Any], container: dict[str, Any],
               scratch: Path, env: dict[str, str], command: list[str]
               ) -> tuple[list[Path], dict[str, str], list[str]]:
        """Mount the container's volumes (see the class docstring); returns the links made,
        and the environment and command with the values naming a mount pointed into its
        folder."""
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        links: list[Path] = []
        for mount in container.get("volumeMounts") or []:
            path = Path(mount["mountPath"])
            if str(path) == "/dev/shm":
                continue
            volume = volumes[mount["name"]]
            if "secret" in volume:
                continue  # written by `Kubelet._secret_volumes`
            if "hostPath" in volume:
                source = Path(volume["hostPath"]["path"])
            elif "emptyDir" in volume:
                source = scratch / "volumes" / volume["name"]
                source.mkdir(parents=True, exist_ok=True)
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                source = self.work_dir / "claims" / namespace / claim
                source.mkdir(parents=True, exist_ok=True)
            else:
                raise RuntimeError(f"volume {volume['name']}: the test kubelet mounts hostPath, "
                                   "emptyDir and persistentVolumeClaim volumes only")
            def moved(value: str, at: str = str(path), to: str = str(source)) -> str:
                return to + value[len(at):] if value == at or value.startswith(f"{at}/") \
                    else value

            if any(moved(v) != v for v in [*env.values(), *command]):
                env = {k: moved(v) for k, v in env.items()}
                command = [moved(arg) for arg in command]
                continue
            if path.exists() or path.is_symlink():
                raise RuntimeError(f"mountPath {path} exists on this machine; the test kubelet "
                                   "mounts by linking there, so use a path that does not exist")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(source, target_is_directory=True)
            links.append(path)
        return links, env, command

    def _resolve_gang(self, namespace: str, labels: dict[str, Any], command: list[str],
                      env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The command and environment of a gang pod with its peers' DNS names resolved to
        loopback addresses and the rendezvous port mapped (see the class docstring)."""
        attempt = str(labels.get(ATTEMPT_LABEL, ""))

        def resolve(value: str) -> str:
            host, colon, port = value.rpartition(":") if ":" in value else (value, "", "")
            match = _POD_DNS.fullmatch(host)
            if match is None or match["namespace"] != namespace:
                return value
            address = f"127.0.0.{1 + int(match['ordinal'])}"
            if not colon:
                return address
            key = (namespace, match["subdomain"], attempt, port)
            with self._lock:
                mapped = self._gang_ports.setdefault(key, client.free_port())
            return f"{address}:{mapped}"

        resolved = list(command)
        for i, arg in enumerate(resolved[:-1]):
            if arg in _GANG_FLAGS:
                resolved[i + 1] = resolve(resolved[i + 1])
        return resolved, {k: resolve(v) if k in _GANG_ENV else v for k, v in env.items()}

    def _secret_volumes(self, namespace: str, pod: str, spec: dict[str, Any],
                        container: dict[str, Any], scratch: Path, env: dict[str, str]
                        ) -> dict[str, str]:
        """Write each mounted Secret volume's keys as files under the pod's scratch folder
        (the Secret as it is now: no later updates), and point the environment values that
        name its mountPath there (a fixed system path cannot be linked per pod here)."""
        volumes = {v["name"]: v for v in spec.get("volumes") or [] if "secret" in v}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                continue
            name = volume["secret"]["secretName"]
            secret = self.client.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
            if secret is None:
                raise RuntimeError(f"pod {namespace}/{pod}: Secret {name} not found")
            target = scratch / "secrets" / mount["mountPath"].lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            for key, value in (secret.get("data") or {}).items():
                (target / key).write_bytes(base64.b64decode(value))
            env = {k: v.replace(mount["mountPath"], str(target)) for k, v in env.items()}
            above = f"{mount['mountPath']}/"  # a value naming a folder of several Secrets
            env = {k: f"{scratch / 'secrets'}{v}" if v.startswith("/")
                   and above.startswith(f"{v.rstrip('/')}/") else v for k, v in env.items()}
        return env

    def _container_env(self, namespace: str, pod: str, container: dict[str, Any]
                       ) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = str(item["value"])
                continue
            source = item.get("valueFrom") or {}
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self.client.get(f"/api/v1/namespaces/{namespace}/secrets/{ref['name']}")
                if secret is None:
                    raise RuntimeError(f"pod {namespace}/{pod}: Secret {ref['name']} not found")
                data = secret.get("data") or {}
                if ref["key"] not in data and ref.get("optional"):
                    continue  # an optional key the Secret lacks: the variable is left unset
                env[item["name"]] = base64.b64decode(data[ref["key"]]).decode()
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                env[item["name"]] = {"metadata.name": pod, "metadata.namespace": namespace,
                                     "status.podIP": "127.0.0.1"}.get(path, "")
        return env

    def _report_exit(self, running: RunningPod) -> None:
        code = running.process.wait()  # it has exited: its callers polled it
        exit_code = code if code >= 0 else 128 - code
        fault = running.fault
        killed = fault is not None and running.name in fault.hits
        reason = "Completed" if exit_code == 0 else (
            fault.container_reason if killed and fault is not None else "Error")
        message = running.termination_path.read_text(encoding="utf-8", errors="replace")
        if not message.strip() and exit_code != 0:  # terminationMessagePolicy FallbackToLogsOnError
            lines = running.log().splitlines()[-LOG_TAIL_LINES:]
            message = "\n".join(lines)[-LOG_TAIL_BYTES:]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod_reason = _DEADLINE_STATUS if running.deadline_exceeded else {}
        path = client.Client.pods_path(running.namespace, running.name)
        pod = self.client.get(path)
        if pod is None:
            return
        # Not Ready any more; the other conditions (a DisruptionTarget the test set) stay, as
        # the kubelet patches conditions by type.
        conditions = [c for c in (pod.get("status") or {}).get("conditions") or []
                      if c.get("type") != "Ready"]
        self._patch(
            path + "/status", {"status": {
                "phase": "Succeeded" if exit_code == 0 and not pod_reason else "Failed",
                "conditions": [*conditions, {"type": "Ready", "status": "False",
                                             "reason": "PodCompleted"}],
                **pod_reason,
                "containerStatuses": [{
                    "name": "trainer", "ready": False, "started": False, "restartCount": 0,
                    "state": {"terminated": {"exitCode": exit_code, "reason": reason,
                                             "message": message, "finishedAt": now}},
                }]}})

    def _patch(self, path: str, patch: dict[str, Any]) -> bool:
        """Merge-patch a pod; False when it is gone (deleted meanwhile: not an error)."""
        try:
            self.client.patch(path, patch)
            return True
        except client.ApiError as exc:
            if exc.status == 404:
                return False
            raise

    def _apply_fault(self, running: RunningPod, now: float) -> None:
        fault = running.fault
        if fault is None or running.name in fault.hits:
            return
        if now - running.last_check < fault.check_every_seconds:
            return
        running.last_check = now
        if fault.when(running):
            fault.hits.append(running.name)
            _release(running)
            _signal_group(running.process, fault.signal)

    def _apply_hold(self, running: RunningPod, now: float) -> None:
        hold = running.hold
        if hold is None:
            return
        if hold.released.is_set():
            running.gate.go(HELD)
            return
        if hold.held.is_set() or now - running.last_hold_check < hold.check_every_seconds:
            return
        running.last_hold_check = now
        if hold.when(running):
            if running.proxy is not None:
                running.proxy.keep_snapshot()
            running.gate.stop(HELD)
            hold.held.set()

    def _ended(self, running: RunningPod) -> None:
        """The process has exited: undo what its start set up."""
        _unmount(running)
        self.throttle.remove(running.gate)
        if running.proxy is not None:
            running.proxy.stop()

    def _terminate(self, running: RunningPod, meta: dict[str, Any], now: float) -> None:
        """The pod is Terminating (`meta` its metadata) or gone ({}): SIGTERM, then SIGKILL
        after its grace period; once the process has exited, a Terminating pod's status is
        reported and the pod removed."""
        if running.process.poll() is None:
            grace = meta.get("deletionGracePeriodSeconds")
            if running.terminating_since is None and isinstance(grace, int):
                running.grace_seconds = float(grace)
            _stop(running, now)
            return
        self._ended(running)
        del self._running[running.uid]
        if meta:  # (a pod already gone is forgotten)
            self._finished[running.uid] = running
            self._report_exit(running)
            self._remove(meta)


# A pod's DNS name under a headless Service: <hostname>.<subdomain>.<namespace>.svc[...].
_POD_DNS = re.compile(r"[a-z0-9-]*?(?P<ordinal>\d+)\.(?P<subdomain>[a-z0-9-]+)\."
                      r"(?P<namespace>[a-z0-9-]+)\.svc(\.[a-z0-9.-]+)?")
_GANG_FLAGS = frozenset({"--rdzv-endpoint", "--rdzv_endpoint", "--local-addr", "--local_addr"})
_GANG_ENV = frozenset({"PET_RDZV_ENDPOINT", "PET_LOCAL_ADDR"})
_DEADLINE_STATUS = {"reason": "DeadlineExceeded",
                    "message": "Pod was active on the node longer than the specified deadline"}


def _past_deadline(pod: dict[str, Any] | None, started_at: float, now: float) -> bool:
    """Whether the pod has been active longer than its spec.activeDeadlineSeconds."""
    deadline = ((pod or {}).get("spec") or {}).get("activeDeadlineSeconds")
    return isinstance(deadline, int) and now - started_at >= deadline


def _stop(running: RunningPod, now: float) -> None:
    """SIGTERM now, SIGKILL once the grace period has passed (call on every poll)."""
    if running.terminating_since is None:
        running.terminating_since = now
        _release(running)
        _signal_group(running.process, signal.SIGTERM)
    elif now - running.terminating_since > running.grace_seconds:
        _signal_group(running.process, signal.SIGKILL)


def _release(running: RunningPod) -> None:
    """Continue a held process (SIGCONT), so that it acts on the signal sent next."""
    if running.hold is not None:
        running.hold.release()
    running.gate.go(HELD)


def _read_metrics(port: int, path: str) -> bytes:
    """GET http://127.0.0.1:`port``path`.

    Raises:
        OSError: no answer, or not 200 (urllib's errors are OSErrors).
    """
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}",
                                    timeout=METRICS_READ_SECONDS) as answer:
            body: bytes = answer.read()
            return body
    except http.client.HTTPException as exc:  # a broken answer
        raise OSError(str(exc)) from exc


def _unmount(running: RunningPod) -> None:
    _unlink(running.mounts)


def _unlink(links: list[Path]) -> None:
    for link in links:
        link.unlink(missing_ok=True)
    links.clear()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _affinity_node(spec: dict[str, Any]) -> str:
    terms = (((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    for term in terms:
        for expression in term.get("matchExpressions") or []:
            if expression.get("key") == "kubernetes.io/hostname" and expression.get("values"):
                return str(expression["values"][0])
    return str(spec.get("nodeName") or "kubesim-node")


def _signal_group(process: subprocess.Popen[bytes] | zygote.Process, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass

