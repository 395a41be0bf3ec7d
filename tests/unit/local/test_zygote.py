"""Trainers forked from the zygote (`kiln.local.zygote`) against new interpreters: a stand-in
``kiln_trainer`` package on PYTHONPATH reports what it sees, and both must see the same path,
environment, working directory, streams, signal handlers and process group; exit codes, signal
deaths and tracebacks come back as Popen gives them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln import contract
from kiln.local import zygote

pytestmark = pytest.mark.process

REPORTER = '''
import json, os, signal, sys, time

def inheritable(fd):
    try:
        return os.get_inheritable(fd)
    except OSError:  # listdir's own, closed by now
        return False


what = sys.argv[1]
if what == "report":
    fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    print(json.dumps({
        "path": sys.path, "cwd": os.getcwd(), "env": dict(os.environ), "argv": sys.argv[1:],
        "main": [__name__, __file__],
        "streams": [[s.encoding, s.errors, s.line_buffering, s.write_through, s.fileno()]
                    for s in (sys.stdin, sys.stdout, sys.stderr)],
        "dont_write_bytecode": sys.dont_write_bytecode,
        "signals": {n: str(signal.getsignal(getattr(signal, n)))
                    for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGCHLD", "SIGPIPE")},
        "group": [os.getpgid(0), os.getsid(0) == os.getpid()],
        "fds": sorted(fd for fd in fds if inheritable(fd)), "all_fds": len(fds),
        "kiln": sorted(m for m in sys.modules if m == "kiln" or m.startswith("kiln.")),
        "helper": __import__("helper").WHERE,
    }))
elif what == "blas":
    import numpy, threadpoolctl
    print(json.dumps([[i["internal_api"], i["num_threads"]]
                      for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]))
elif what == "exit":
    sys.exit(int(sys.argv[2]))
elif what == "crash":
    raise ValueError("the trainer's own bug")
elif what == "signal":
    if int(sys.argv[2]) == signal.SIGINT:  # as at a terminal: a test worker may ignore SIGINT
        signal.signal(signal.SIGINT, signal.default_int_handler)
    print("running", flush=True)
    os.kill(os.getpid(), int(sys.argv[2]))
    # As a Ctrl-C that lands mid-training: the handler's exception comes from the trainer's
    # own code (the sleep ends at the signal), not from after its last line.
    time.sleep(600)
elif what == "wait":
    print("running", flush=True)
    sys.stdin.read()  # until the test closes its end
'''


@pytest.fixture
def fake_trainer(tmp_path: Path) -> Path:
    """A folder holding a stand-in ``kiln_trainer`` and a `helper` module it imports."""
    package = tmp_path / "fake" / "kiln_trainer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "__main__.py").write_text(REPORTER, encoding="utf-8")
    (package.parent / "helper.py").write_text("WHERE = 'fake'\n", encoding="utf-8")
    return package.parent


def _env(fake: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{fake}{os.pathsep}relative",
            "KILN_TEST_VALUE": "fork", **extra}


class _Run:
    """A trainer started by `zygote.start` with its stdout on a pipe and stderr to a file."""

    def __init__(self, args: list[str], *, env: dict[str, str], cwd: Path, stderr: Path,
                 new_session: bool = False, stdin: int | None = None) -> None:
        read, write = os.pipe()
        with open(stderr, "wb") as err:
            process = zygote.start([sys.executable, "-m", zygote.MODULE, *args], env=env,
                                   cwd=str(cwd), stdin=stdin, stdout=write, stderr=err.fileno(),
                                   new_session=new_session,
                                   text_stdout=open(read, encoding="utf-8"))  # noqa: SIM115
        os.close(write)
        assert process is not None, "the zygote did not start it"
        assert process.stdout is not None
        self.process, self.stdout = process, process.stdout

    def output(self) -> str:
        text = self.stdout.read()
        self.stdout.close()
        return text


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Any]:
    started: list[_Run] = []

    def start(args: list[str], **kwargs: Any) -> _Run:
        kwargs.setdefault("stderr", tmp_path / "stderr.txt")
        r = _Run(args, **kwargs)
        started.append(r)
        return r

    yield start
    for r in started:
        r.process.kill()
        r.process.wait(timeout=60)


def _fresh(args: list[str], *, env: dict[str, str], cwd: Path, new_session: bool = False
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", zygote.MODULE, *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False,
                          start_new_session=new_session)


@pytest.mark.parametrize(("new_session", "unbuffered"), [(False, "1"), (True, "")],
                         ids=["our-group-unbuffered", "own-session-buffered"])
def test_a_forked_trainer_sees_what_a_new_interpreter_sees(
        tmp_path: Path, fake_trainer: Path, run: Any, new_session: bool, unbuffered: str
) -> None:
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "helper.py").write_text("WHERE = 'cwd'\n", encoding="utf-8")  # cwd comes first
    env = _env(fake_trainer, PYTHONDONTWRITEBYTECODE=unbuffered, PYTHONUNBUFFERED=unbuffered)
    forked = run(["report", "--flag"], env=env, cwd=cwd, new_session=new_session)
    seen = json.loads(forked.output())
    assert forked.process.wait(timeout=120) == 0
    fresh = _fresh(["report", "--flag"], env=env, cwd=cwd, new_session=new_session)
    assert fresh.returncode == 0, fresh.stderr
    expected = json.loads(fresh.stdout)
    # a new interpreter's process group is its own only with a session of its own
    for report in (seen, expected):
        group, leader = report.pop("group")
        assert leader is new_session
        assert (group == os.getpgid(0)) is not new_session
    # one more, never inherited: the pipe it reports its exit code on (`zygote.Process`)
    assert seen.pop("all_fds") == expected.pop("all_fds") + 1
    assert seen == expected
    assert seen["helper"] == "cwd" and seen["kiln"] == []


def test_each_child_gets_its_own_environment_and_path_not_the_previous_ones(
        tmp_path: Path, fake_trainer: Path, run: Any) -> None:
    first = run(["report"], env=_env(fake_trainer, KILN_TEST_ONLY_FIRST="1"), cwd=tmp_path)
    assert json.loads(first.output())["env"]["KILN_TEST_ONLY_FIRST"] == "1"
    other = tmp_path / "other"
    other.mkdir()
    (other / "helper.py").write_text("WHERE = 'other'\n", encoding="utf-8")
    second = run(["report"], env=_env(fake_trainer), cwd=other)
    seen = json.loads(second.output())
    assert "KILN_TEST_ONLY_FIRST" not in seen["env"]
    assert seen["cwd"] == str(other) and seen["helper"] == "other"
    assert first.process.wait(timeout=60) == second.process.wait(timeout=60) == 0


@pytest.mark.parametrize(("args", "code"), [
    pytest.param(["exit", "3"], 3, id="exit-code"),
    pytest.param(["exit", "0"], 0, id="exit-0"),
    pytest.param(["signal", str(int(signal.SIGKILL))], -signal.SIGKILL, id="killed"),
    pytest.param(["signal", str(int(signal.SIGINT))], -signal.SIGINT, id="ctrl-c-unhandled"),
])
def test_exit_codes_and_signal_deaths_are_those_popen_reports(
        tmp_path: Path, fake_trainer: Path, run: Any, args: list[str], code: int) -> None:
    env = _env(fake_trainer)
    forked = run(args, env=env, cwd=tmp_path)
    forked.output()
    assert forked.process.wait(timeout=120) == code == forked.process.returncode
    assert forked.process.poll() == code
    assert _fresh(args, env=env, cwd=tmp_path).returncode == code


def test_a_crash_writes_its_traceback_to_stderr_and_exits_1(
        tmp_path: Path, fake_trainer: Path, run: Any) -> None:
    forked = run(["crash"], env=_env(fake_trainer), cwd=tmp_path, stderr=tmp_path / "log")
    forked.output()
    assert forked.process.wait(timeout=120) == 1
    log = (tmp_path / "log").read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in log
    assert "ValueError: the trainer's own bug" in log
    assert "kiln_trainer/__main__.py" in log and "zygote.py" not in log


def test_wait_times_out_and_sigterm_ends_a_running_child(
        tmp_path: Path, fake_trainer: Path, run: Any) -> None:
    read, write = os.pipe()  # its stdin: it runs until the test closes `write`
    try:
        forked = run(["wait"], env=_env(fake_trainer), cwd=tmp_path, stdin=read)
    finally:
        os.close(read)
    assert forked.stdout.readline() == "running\n"
    assert forked.process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        forked.process.wait(timeout=0.2)
    forked.process.send_signal(signal.SIGTERM)
    assert forked.process.wait(timeout=120) == -signal.SIGTERM
    forked.process.kill()  # after its end: nothing is signalled, as with Popen
    os.close(write)


def test_a_trainer_with_several_threads_is_forked_and_gets_numpy_s_threads_as_if_new(
        tmp_path: Path, fake_trainer: Path, run: Any) -> None:
    env = _env(fake_trainer, OMP_NUM_THREADS="3")  # as `kiln run` gives on 6 cores or more
    forked = run(["blas"], env=env, cwd=tmp_path)  # forked, not refused for the zygote's threads
    seen = json.loads(forked.output())
    assert forked.process.wait(timeout=120) == 0
    fresh = _fresh(["blas"], env=env, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert seen == json.loads(fresh.stdout) and seen


def test_what_is_not_forked(tmp_path: Path, fake_trainer: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(fake_trainer)
    cwd = str(tmp_path)
    trainer = [sys.executable, "-m", zygote.MODULE, "report"]
    assert zygote.forkable(trainer, env, cwd)
    assert not zygote.forkable(["torchrun", "-m", zygote.MODULE], env, cwd)
    assert not zygote.forkable([sys.executable, "-m", "other"], env, cwd)
    other = tmp_path / "bin" / "python"
    other.parent.mkdir()
    other.symlink_to(sys.executable)  # the same program, another environment (a venv's folder)
    assert not zygote.forkable([str(other), "-m", zygote.MODULE], env, cwd)
    (fake_trainer / "numpy").mkdir()  # the job's path shadows a preloaded package
    assert not zygote.forkable(trainer, env, cwd)
    monkeypatch.setenv(contract.Env.FORK_TRAINERS, "0")
    assert zygote.start(trainer, env=env, stdout=1, stderr=2) is None


def test_a_module_of_the_package_is_forked_and_runs_as_python_m_runs_it(
        tmp_path: Path, fake_trainer: Path) -> None:
    (fake_trainer / "kiln_trainer" / "initializer.py").write_text(
        "import json, sys\nprint(json.dumps([__name__, sys.argv[1:]]))\n", encoding="utf-8")
    env, cwd = _env(fake_trainer), str(tmp_path)
    command = [sys.executable, "-m", f"{zygote.MODULE}.initializer", "--job", "j.json"]
    assert zygote.forkable(command, env, cwd)
    assert not zygote.forkable([sys.executable, "-m", f"{zygote.MODULE}_other"], env, cwd)
    out = tmp_path / "out.txt"
    with open(out, "wb") as log:
        process = zygote.start(command, env=env, cwd=cwd, stdout=log.fileno(),
                               stderr=log.fileno())
        assert process is not None, "the zygote did not start it"
        assert process.wait(timeout=120) == 0
    fresh = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=120, check=False)
    assert out.read_text(encoding="utf-8") == fresh.stdout == '["__main__", ["--job", "j.json"]]\n'


def test_load_time_variables_pick_the_zygote() -> None:
    one = {"OMP_NUM_THREADS": "1", "PATH": "/bin", "PYTHONPATH": "/a", "KILN_ZOO": "z"}
    assert zygote.load_time(one) == (("OMP_NUM_THREADS", "1"),)
    assert zygote.load_time({**one, "PYTHONPATH": "/b", "KILN_ZOO": "y"}) == zygote.load_time(one)
    assert zygote.load_time({**one, "OMP_NUM_THREADS": "2"}) != zygote.load_time(one)
    assert zygote.load_time({**one, "PYTHONHASHSEED": "0"}) != zygote.load_time(one)
    # torchrun's per-worker variables: the workers of one launch share a zygote
    assert zygote.load_time({**one, "TORCHELASTIC_ERROR_FILE": "/tmp/rank0/error.json",
                             "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == zygote.load_time(one)


def test_a_child_polled_by_threads_while_another_waits_ends_once_for_all(
        tmp_path: Path, fake_trainer: Path, run: Any) -> None:
    # As `kiln sweep run` on Ctrl-C: each trial's watcher polls while the main thread waits;
    # the pipe that reports the exit code must be closed once, whoever sees the end first.
    read, write = os.pipe()
    try:
        forked = run(["wait"], env=_env(fake_trainer), cwd=tmp_path, stdin=read)
    finally:
        os.close(read)
    assert forked.stdout.readline() == "running\n"
    seen: list[int | None] = []
    errors: list[BaseException] = []

    def watch() -> None:
        try:
            while (code := forked.process.poll()) is None:
                pass
            seen.append(code)
        except BaseException as error:  # noqa: BLE001 -- the test reports it
            errors.append(error)

    watchers = [threading.Thread(target=watch) for _ in range(6)]
    for watcher in watchers:
        watcher.start()
    forked.process.send_signal(signal.SIGTERM)
    assert forked.process.wait(timeout=120) == -signal.SIGTERM
    for watcher in watchers:
        watcher.join(timeout=120)
    os.close(write)
    assert errors == []
    assert seen == [-signal.SIGTERM] * 6


def test_its_end_stops_the_children_started_to_stop_with_us_and_no_other(
        tmp_path: Path, fake_trainer: Path, run: Any) -> None:
    # As when `kiln run` dies (the zygote's end of file, or its parent-death signal): the
    # zygote asks the trainers `kiln run` started to stop (SIGTERM); other children go on.
    ours = _env(fake_trainer, **{contract.Env.STOP_WITH_PARENT: str(os.getpid())})
    reported = run(["report"], env=ours, cwd=tmp_path)
    # the zygote is its parent and stops it: the trainer has nothing to arm
    assert contract.Env.STOP_WITH_PARENT not in json.loads(reported.output())["env"]
    assert reported.process.wait(timeout=60) == 0
    read, write = os.pipe()  # their stdin: they run until the test closes `write`
    try:
        stopping = run(["wait"], env=ours, cwd=tmp_path, stdin=read)
        staying = run(["wait"], env=_env(fake_trainer), cwd=tmp_path, stdin=read)
    finally:
        os.close(read)
    assert stopping.stdout.readline() == staying.stdout.readline() == "running\n"
    zygote.close_all()
    assert stopping.process.wait(timeout=60) < 0  # a signal (which one went with the zygote)
    assert staying.process.poll() is None
    os.close(write)
    assert staying.process.wait(timeout=60) == 0


def test_a_second_ctrl_c_while_closing_ends_the_wait_and_the_zygote_still_stops_ours(
        tmp_path: Path, fake_trainer: Path, run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = _env(fake_trainer, **{contract.Env.STOP_WITH_PARENT: str(os.getpid())})
    read, write = os.pipe()
    try:
        stopping = run(["wait"], env=ours, cwd=tmp_path, stdin=read)
    finally:
        os.close(read)
    assert stopping.stdout.readline() == "running\n"

    def interrupted_close(self: zygote.Zygote) -> None:  # Ctrl-C as it waits for the zygote
        self._socket.shutdown(socket.SHUT_RDWR)
        raise KeyboardInterrupt

    monkeypatch.setattr(zygote.Zygote, "close", interrupted_close)
    zygote.close_all()  # no KeyboardInterrupt escapes into the interpreter's exit
    assert stopping.process.wait(timeout=60) < 0  # the zygote still stopped ours
    os.close(write)
