"""`kiln` commands in the test's own process: `kiln.cli.main` with the argv, working directory and
environment a shell would give it, its exit code and output captured. The trainers it starts are
processes all the same; only the second interpreter's start-up (torch imported again) is saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Mapping
from pathlib import Path
from unittest import mock

from kiln import cli


@dataclasses.dataclass(frozen=True)
class Done:
    """What a finished `kiln` command left (the fields of `subprocess.CompletedProcess`)."""

    returncode: int
    stdout: str
    stderr: str


def kiln(*args: str, cwd: Path, env: Mapping[str, str] | None = None) -> Done:
    """Run ``kiln ARGS`` in `cwd` with exactly `env` (default: this process's environment).

    stdout and stderr are strings, not terminals, as for a pipe: plain output, no bars.
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        if env is not None:
            stack.enter_context(mock.patch.dict(os.environ, env, clear=True))
        stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        code = cli.main(list(args))
    return Done(code, out.getvalue(), err.getvalue())


def kiln_ok(*args: str, cwd: Path) -> Done:
    """`kiln` as a job's user runs it here: one thread per trainer, line-buffered output, no zoo
    from the environment (the job or the flags name it); asserts it exited 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("KILN_ZOO", None)
    done = kiln(*args, cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done
