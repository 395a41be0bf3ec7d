"""Trainers forked from a process that has already imported torch: a zygote.

A new ``python -m kiln_trainer`` (or ``kiln_trainer.initializer``) spends 2-3 of its first
CPU-seconds importing torch and the libraries under it. The zygote imports them once (never
Kiln's own modules: they read the environment when imported) and forks a child per trainer,
which takes the trainer's environment, working directory, standard streams and Python path as a
new interpreter would, then runs it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import importlib
import io
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, NoReturn

MODULE = "kiln_trainer"  # its modules are forked: the trainer, the initializer
# What `kiln_trainer` imports beyond Kiln; a package a trainer's own path shadows is not forked.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.optim", "torch.utils.data",
           "numpy", "sympy", "pydantic", "yaml", "minio", "networkx", "safetensors.torch",
           "prometheus_client")
# Variables the interpreter or the preloaded libraries read while they load: a child keeps the
# zygote's reading, so trainers whose values differ get a zygote of their own.
LOAD_TIME_PREFIXES = ("PYTHON", "LANG", "LC_", "TZ", "LD_", "MALLOC_", "OMP_", "GOMP_", "KMP_",
                      "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "NPY_", "SYMPY_", "PROMETHEUS_")
# ... except these, which the child applies as a new interpreter would.
APPLIED = frozenset({"PYTHONPATH", "PYTHONSAFEPATH", "PYTHONUNBUFFERED",
                     "PYTHONDONTWRITEBYTECODE"})
# ... and torchrun's per-worker variables, which torch reads as it runs (each rank's error file
# differs): the workers of one launch share a zygote.
RUN_TIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")
MAX_ZYGOTES = 3  # each holds torch's few hundred MB; more differing trainers start as processes
_MESSAGE_BYTES = 1 << 18  # beyond the socket's buffer: a larger environment is not forked
# The kernel sends it when our parent dies (PR_SET_PDEATHSIG): catchable, unlike SIGKILL, so
# the zygote can pass the stop on to its trainers first; no process group signal uses it.
_PARENT_GONE = signal.SIGUSR1
_CHANGED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, _PARENT_GONE)
_PR_SET_PDEATHSIG = 1
# numpy's OpenBLAS starts its threads as it loads (OMP_NUM_THREADS of them), and a process that
# runs threads cannot fork: the zygote loads it with one, each child sets a new one's count.
_ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1"}


class ZygoteGone(RuntimeError):
    """The zygote exited or refused to fork; start the trainer as a process of its own."""


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether trainers may be forked: on Linux (fork, fd passing), unless ``KILN_FORK_TRAINERS=0``
    (set it to rule the zygote out when a trainer misbehaves)."""
    # imported here: the zygote runs this file as a script, importing nothing of Kiln's
    from kiln import contract

    return (sys.platform == "linux" and hasattr(socket, "send_fds")
            and environ.get(contract.Env.FORK_TRAINERS, "1") != "0")


def forkable(command: Sequence[str], env: Mapping[str, str], cwd: str) -> bool:
    """Whether `command` is ``python -m kiln_trainer[.module] ...`` with this interpreter (found
    on `env`'s PATH as the child would find it) and no preloaded package shadowed on its path."""
    if len(command) < 3 or command[1] != "-m" or command[2].partition(".")[0] != MODULE:
        return False
    found = shutil.which(command[0], path=env.get("PATH", os.defpath))
    ours = os.path.abspath(sys.executable)
    # python and python3 of one environment are one program; a link elsewhere (another venv)
    # is another environment
    if found is None or os.path.dirname(os.path.abspath(found)) != os.path.dirname(ours) \
            or not os.path.samefile(found, ours):
        return False
    tops = {name.partition(".")[0] for name in PRELOAD}
    folders = [cwd, *_python_path(env, cwd)]
    return not any(os.path.exists(os.path.join(folder, top)) or
                   os.path.exists(os.path.join(folder, f"{top}.py"))
                   for folder in folders for top in tops)


def load_time(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """`env`'s variables that a zygote fixes when it starts (`LOAD_TIME_PREFIXES`)."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(LOAD_TIME_PREFIXES) and k not in APPLIED
                        and not k.startswith(RUN_TIME_PREFIXES)))


class Process:
    """A forked trainer, read and signalled as a `subprocess.Popen`.

    The zygote reaps it and reports its exit code. Should the zygote die first (killed), the
    child goes on, and its exit code comes from `status`: a pipe it writes its code to as it
    ends (end of file without a code: a signal killed it, which one is lost with the zygote).
    Should we end first, the zygote stops the children started to stop with us (`start`).
    """

    def __init__(self, zygote: Zygote, pid: int, stdout: IO[str] | None = None,
                 status: int | None = None) -> None:
        self._zygote, self.pid, self.stdout = zygote, pid, stdout
        self._status = status
        # a watcher thread polls while another waits: the status pipe is closed once, by one
        self._status_lock = threading.Lock()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._ended(self._zygote.exit_code(self.pid))
            except ZygoteGone:
                self._ended(self._own_report(0.0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                self._ended(self._zygote.wait_exit(self.pid, timeout))
            except ZygoteGone:
                self._ended(self._own_report(
                    None if deadline is None else max(0.0, deadline - time.monotonic())))
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode

    def _ended(self, code: int | None) -> None:
        if code is not None:
            with self._status_lock:
                self.returncode = code
                if self._status is not None:
                    os.close(self._status)
                    self._status = None

    def _own_report(self, timeout: float | None) -> int | None:
        """The code the child wrote to `status` as it ended; None while it runs."""
        # held while waiting, so that no other thread closes the pipe under the poll
        with self._status_lock:
            if self.returncode is not None:
                return self.returncode
            if self._status is None:
                raise ChildProcessError(f"the zygote exited before it reported pid {self.pid}")
            ready = select.poll()  # not select.select: a busy process's fds pass 1024
            ready.register(self._status, select.POLLIN)
            if not ready.poll(None if timeout is None else int(timeout * 1000)):
                return None
            written = os.read(self._status, 16)
        return int(written) if written.strip().lstrip(b"-").isdigit() else -signal.SIGKILL

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid the zygote has reaped
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A zygote process and the thread that reads its answers."""

    def __init__(self, env: Mapping[str, str]) -> None:
        """Start one whose load-time variables (`load_time`) are `env`'s; the rest of its
        environment is this process's, without PYTHONPATH (its path is the interpreter's own)."""
        self.load_time = load_time(env)
        own = {k: v for k, v in os.environ.items()
               if not k.startswith(LOAD_TIME_PREFIXES) or k in APPLIED}
        own.pop("PYTHONPATH", None)
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            # Run as a script: no Kiln module is imported there. Its process group and session
            # are ours, as a Popen child's would be; "/": it holds no folder of ours.
            self._process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(theirs.fileno()),
                 str(os.getpid())], cwd="/",
                env={**own, **dict(self.load_time), **_ONE_BLAS_THREAD},
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self._lock = threading.Condition()
        self._answers: dict[int, dict[str, Any]] = {}  # request id -> started or failed
        self._exits: dict[int, int] = {}  # pid -> exit code (negative: the signal)
        self._requests = 0
        self.gone = False
        self._reader = threading.Thread(target=self._read, name="kiln-zygote", daemon=True)
        self._reader.start()

    def fork(self, module: str, args: Sequence[str], *, cwd: str, env: Mapping[str, str],
             fds: tuple[int, int, int, int], new_session: bool, stop_with_us: bool = False
             ) -> int:
        """Fork a child that runs ``python -m MODULE ARGS`` with `fds` as its stdin,
        stdout and stderr, and the write end of the pipe it reports its exit code on
        (`Process`), in a session of its own if `new_session`; its pid. With `stop_with_us`
        the zygote sends it SIGTERM when this process ends or closes the zygote.

        Raises:
            ZygoteGone: the zygote exited or could not fork (nothing was started).
        """
        with self._lock:
            if self.gone:
                raise ZygoteGone("the zygote exited")
            self._requests += 1
            request = self._requests
            message = json.dumps({"id": request, "module": module, "args": list(args),
                                  "cwd": cwd, "env": dict(env), "session": new_session,
                                  "stop": stop_with_us}).encode()
            try:
                socket.send_fds(self._socket, [message], list(fds))
            except OSError as exc:
                raise ZygoteGone(f"the zygote is unreachable ({exc})") from None
            self._lock.wait_for(lambda: request in self._answers or self.gone)
            answer = self._answers.pop(request, {})
            if "pid" not in answer:
                raise ZygoteGone(answer.get("failed", "the zygote exited"))
            return int(answer["pid"])

    def exit_code(self, pid: int) -> int | None:
        """`pid`'s exit code; None while it runs.

        Raises:
            ZygoteGone: the zygote exited before reporting it.
        """
        with self._lock:
            if pid not in self._exits and self.gone:
                raise ZygoteGone(f"the zygote exited before it reported pid {pid}")
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._lock:
            self._lock.wait_for(lambda: pid in self._exits or self.gone, timeout)
            return self.exit_code(pid)

    def close(self) -> None:
        """Stop the zygote (it exits at end of file); children still running go on, but for
        those forked `stop_with_us`, which it sends SIGTERM first."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=30)
        self._socket.close()

    def _read(self) -> None:
        while True:
            try:
                data = self._socket.recv(_MESSAGE_BYTES)
            except OSError:
                data = b""
            with self._lock:
                if not data:
                    self.gone = True
                    self._lock.notify_all()
                    return
                answer = json.loads(data)
                if "exited" in answer:
                    self._exits[int(answer["exited"])] = int(answer["code"])
                else:
                    self._answers[int(answer["id"])] = answer
                self._lock.notify_all()


_zygotes: dict[tuple[tuple[str, str], ...], Zygote] = {}
_zygotes_lock = threading.Lock()


def shared(env: Mapping[str, str]) -> Zygote | None:
    """This process's zygote for `env`'s load-time variables, started on first use and closed
    at exit; None when it exited, cannot start, or `MAX_ZYGOTES` already run."""
    key = load_time(env)
    with _zygotes_lock:
        if key not in _zygotes:
            if len(_zygotes) >= MAX_ZYGOTES:
                return None
            if not _zygotes:
                atexit.register(close_all)
            try:
                _zygotes[key] = Zygote(env)
            except OSError:
                return None
        zygote = _zygotes[key]
        return None if zygote.gone else zygote


def close_all() -> None:
    """Stop every zygote of this process. A second Ctrl-C while it waits for them ends the
    wait, not the zygotes: each still stops the trainers it forked for us once our end of its
    socket closes, as this process exits."""
    with _zygotes_lock:
        with contextlib.suppress(KeyboardInterrupt):
            for zygote in _zygotes.values():
                zygote.close()
        _zygotes.clear()


def start(command: Sequence[str], *, env: Mapping[str, str], cwd: str | None = None,
          stdin: int | None = None, stdout: int, stderr: int, new_session: bool = False,
          text_stdout: IO[str] | None = None) -> Process | None:
    """Fork `command` (see `forkable`) from this process's zygote, or None where it cannot be
    (`enabled`, `forkable`, `shared`): then start it as a process of its own.

    Args:
        command: ``python -m kiln_trainer[.module] ARGS``.
        env: the child's whole environment. With `contract.Env.STOP_WITH_PARENT` (our pid) the
            child is to stop when we end: the zygote, its parent, sends it SIGTERM then, so
            the variable is left out (the trainer would follow the zygote's life, not ours).
        cwd: its working directory (default: ours).
        stdin, stdout, stderr: file descriptors it gets as 0, 1, 2 (stdin default: ours).
        new_session: give it a session (and process group) of its own, as Popen's
            ``start_new_session``; else it shares ours.
        text_stdout: what `Process.stdout` reads (the parent's end of a stdout pipe).
    """
    from kiln import contract

    where = os.getcwd() if cwd is None else str(cwd)
    if not (enabled() and forkable(command, env, where)):
        return None
    zygote = shared(env)
    if zygote is None:
        return None
    stop_with_us = contract.Env.STOP_WITH_PARENT in env
    env = {k: v for k, v in env.items() if k != contract.Env.STOP_WITH_PARENT}
    null = os.open(os.devnull, os.O_RDONLY) if stdin is None and not _is_open(0) else None
    status, theirs = os.pipe()
    try:
        pid = zygote.fork(command[2], command[3:], cwd=where, env=env, new_session=new_session,
                          fds=(null if null is not None else stdin or 0, stdout, stderr, theirs),
                          stop_with_us=stop_with_us)
    except ZygoteGone:
        os.close(status)
        return None
    finally:
        os.close(theirs)
        if null is not None:
            os.close(null)
    return Process(zygote, pid, text_stdout, status)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _python_path(env: Mapping[str, str], cwd: str) -> list[str]:
    """PYTHONPATH's folders as a new interpreter in `cwd` puts them on sys.path (an empty entry
    is the working directory)."""
    value = env.get("PYTHONPATH", "")
    return [os.path.normpath(os.path.join(cwd, p)) for p in value.split(os.pathsep)] if value \
        else []


# The zygote's side: one thread, so forking is safe.

def _serve(channel: socket.socket, base_path: list[str], initial: dict[int, Any],
           parent: int) -> None:
    """Requests in, pids and exit codes out, until end of file or `parent`'s end; then SIGTERM
    to the children asked to stop with it (they checkpoint, as at a Ctrl-C)."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    # both wake `select` through the wakeup fd
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(_PARENT_GONE, lambda *_: None)
    stopping: set[int] = set()  # unreaped, so their pids are not reused before the signal
    try:
        # a thread of the parent that ends sends _PARENT_GONE too: only another parent counts
        while os.getppid() == parent:
            readable, _, _ = select.select([channel.fileno(), wake_read], [], [])
            if wake_read in readable:
                os.read(wake_read, 4096)
            if channel.fileno() in readable:
                message, fds, _, _ = socket.recv_fds(channel, _MESSAGE_BYTES, 4)
                if not message:
                    return
                request = json.loads(message)
                try:
                    answer = _fork(channel, request, fds, base_path, initial)
                finally:
                    for fd in fds:
                        os.close(fd)
                if "pid" in answer and request.get("stop"):
                    stopping.add(answer["pid"])
                channel.send(json.dumps({"id": request["id"], **answer}).encode())
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                stopping.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                channel.send(json.dumps({"exited": pid, "code": code}).encode())
    finally:
        for pid in stopping:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def _fork(channel: socket.socket, request: dict[str, Any], fds: list[int],
          base_path: list[str], initial: dict[int, Any]) -> dict[str, Any]:
    if len(fds) != 4:
        return {"failed": f"expected 4 file descriptors, got {len(fds)}"}
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        return {"failed": "the zygote runs threads; forking it is unsafe"}
    ready, confirm = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:  # out of processes or memory: the caller starts it itself
        os.close(ready)
        os.close(confirm)
        return {"failed": f"cannot fork ({exc})"}
    if pid == 0:
        os.close(ready)
        _child(channel, request, fds, confirm, base_path, initial)
    os.close(confirm)
    os.read(ready, 1)  # its session and signal handlers are set: it may be signalled
    os.close(ready)
    return {"pid": pid}


def _child(channel: socket.socket, request: dict[str, Any], fds: list[int], confirm: int,
           base_path: list[str], initial: dict[int, Any]) -> NoReturn:
    """In the forked child: become the trainer as a new interpreter would, run it, exit."""
    try:
        channel.close()
        if request["session"]:
            os.setsid()
        signal.set_wakeup_fd(-1)
        for signum, handler in initial.items():
            signal.signal(signum, handler)
        os.write(confirm, b"x")
        status = os.dup(fds[3])  # non-inheritable: the trainer's own programs never get it
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        # the zygote's socket, pipes, received fds
        os.closerange(3, status)
        os.closerange(status + 1, os.sysconf("SC_OPEN_MAX"))
        cwd, env = request["cwd"], request["env"]
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        _blas_threads(env)
        _standard_streams(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        path = dict.fromkeys([*_python_path(env, cwd), *base_path])
        sys.path[:] = [*([] if env.get("PYTHONSAFEPATH") else [cwd]), *path]
        sys.path_importer_cache.clear()
        importlib.invalidate_caches()
        if "numpy.random" in sys.modules:  # seeded from entropy per process, as when imported
            sys.modules["numpy.random"].seed()
        module = str(request.get("module", MODULE))  # the trainer unless another is named
        sys.argv = [module, *request["args"]]
    except BaseException as exc:  # noqa: BLE001 - the trainer's log says why it never ran
        with contextlib.suppress(BaseException):
            os.write(2, f"kiln zygote: cannot start the trainer: {exc!r}\n".encode())
        os._exit(1)
    _run_main(status, module)


def _blas_threads(env: Mapping[str, str]) -> None:
    """Give numpy's OpenBLAS the threads it takes when it loads in a new interpreter with `env`
    (the first of these variables, at most one per core we may run on), not the zygote's one."""
    if "numpy" not in sys.modules:
        return
    cores = len(os.sched_getaffinity(0))
    wanted = next((env[k] for k in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                    "OMP_NUM_THREADS") if env.get(k)), None)
    threads = min(int(wanted), cores) if wanted and wanted.isdigit() else cores
    if threads > 1:
        import threadpoolctl

        threadpoolctl.threadpool_limits(threads, user_api="blas")


def _standard_streams(*, unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr on fds 0-2, made as the interpreter makes them."""
    def stream(fd: int, old: IO[str] | None, write: bool, *, errors: str | None = None
               ) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
        binary: Any = raw if write and unbuffered else (
            io.BufferedWriter(raw) if write else io.BufferedReader(raw))
        encoding = getattr(old, "encoding", None) or "utf-8"
        return io.TextIOWrapper(binary, encoding=encoding,
                                errors=errors or getattr(old, "errors", None) or "strict",
                                newline="\n" if write else None,
                                line_buffering=not unbuffered and (fd == 2 or raw.isatty()),
                                write_through=unbuffered)

    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        new = stream(fd, getattr(sys, f"__{name}__"), fd > 0,
                     errors="backslashreplace" if fd == 2 else None)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)  # the originals, as a new interpreter has them


def _run_main(code_pipe: int, module: str) -> NoReturn:
    """Run `module` as ``__main__`` and end as the interpreter ends: exit code, traceback,
    non-daemon threads joined, atexit handlers, streams flushed, death by SIGINT; the code also
    written to `code_pipe` (`Process`'s status) by whichever `os._exit` ends it, the
    trainer's own too."""
    real_exit, trainer = os._exit, os.getpid()

    def exit_reporting(status: int) -> NoReturn:
        if os.getpid() == trainer:  # not a process the trainer forked (a DataLoader worker)
            _report(code_pipe, status & 0xFF)
        real_exit(status)

    os._exit = exit_reporting
    code, interrupted = 0, False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # noqa: BLE001 - a crash: its traceback goes to its log
        frames = exc.__traceback__
        exc.__traceback__ = frames.tb_next if frames else None  # from runpy's frames, as -m
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
    with contextlib.suppress(BaseException):
        getattr(threading, "_shutdown")()  # noqa: B009 - join non-daemon threads
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if interrupted and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _report(code_pipe, -signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _report(pipe: int, code: int) -> None:
    with contextlib.suppress(OSError):
        os.write(pipe, str(code).encode())


def _watch_parent(parent: int) -> None:
    """Have the kernel send `_PARENT_GONE` when `parent` (this process's) dies, however it dies
    (killed too, when end of file may never come: a process it forked can hold its end)."""
    signal.signal(_PARENT_GONE, lambda *_: None)  # until `_serve` acts on it: no child yet
    with contextlib.suppress(OSError, AttributeError):  # no prctl: end of file stops us
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(_PARENT_GONE))
    # it died before the signal was armed: `_serve` sees `os.getppid()` differ and returns


def _main(fd: int, parent: int) -> None:
    initial: dict[int, Any] = {s: h for s in _CHANGED_SIGNALS
                               if (h := signal.getsignal(s)) is not None}
    # the interpreter's own path, without this script's folder (Kiln's modules)
    base_path = sys.path[1:]
    sys.path[:] = base_path
    # Ctrl-C and a stop signal to our process group are the trainers'; the zygote ends at end
    # of file, when its parent closes it or exits, or when its parent dies
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    _watch_parent(parent)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # a trainer importing it reports it
            importlib.import_module(name)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # our parent is gone
        _serve(socket.socket(fileno=fd), base_path, initial, parent)


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]))
