"""User code as models: import ``package.module:callable`` and call it, with errors that name
the job field and the user's file and line.

Only trainer processes (and their tools) call this; the operator never imports user code.
"""

from __future__ import annotations

import importlib
import os
import re
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from kiln import api

MODEL_FIELD = "spec.model.entrypoint"
# The tail of a traceback kept in a message: the last frames of the user's code.
TAIL_FRAMES = 3


class EntrypointError(ValueError):
    """User code could not give what the job asks for; the message names the field, and the
    user's file and line when their code raised (the tail of the traceback)."""


def load(entrypoint: str, *, field: str = MODEL_FIELD) -> Callable[..., Any]:
    """Import ``package.module:callable`` and return the callable.

    Args:
        entrypoint: ``package.module:attribute[.attribute...]``.
        field: the job field that names it, for messages.

    Raises:
        EntrypointError: a malformed entrypoint; a module that is not on the Python path; an
            error while importing the user's module (its file and line); a missing attribute
            (with the module's file); an attribute that is not callable.
    """
    if not re.match(api.ENTRYPOINT_PATTERN, entrypoint):
        raise EntrypointError(f"{field}: {entrypoint!r} is not package.module:callable, e.g. "
                              "mynets.mixer:mixer")
    module_name, _, attribute_path = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and _is_prefix(exc.name, module_name):
            raise EntrypointError(
                f"{field}: cannot import {module_name!r} of {entrypoint} (no module named "
                f"{exc.name!r}); put its folder on PYTHONPATH (kiln run adds the job file's "
                "folder) or install it in the trainer image") from None
        raise EntrypointError(_raised(f"{field}: importing {module_name!r} of {entrypoint}",
                                      exc)) from None
    except Exception as exc:  # noqa: BLE001  # any error in the user's module body
        raise EntrypointError(_raised(f"{field}: importing {module_name!r} of {entrypoint}",
                                      exc)) from None
    target: Any = module
    for part in attribute_path.split("."):
        if not hasattr(target, part):
            where = getattr(module, "__file__", None) or module_name
            raise EntrypointError(
                f"{field}: {module_name} ({_short_path(where)}) has no attribute {part!r} "
                f"(entrypoint {entrypoint}); check the name after the colon")
        target = getattr(target, part)
    if not callable(target):
        raise EntrypointError(f"{field}: {entrypoint} is not callable (got "
                              f"{type(target).__name__} {repr(target)[:60]}); name a function "
                              "or class that builds the model")
    return target  # type: ignore[no-any-return]


def call(entrypoint: str, args: Mapping[str, Any], *, field: str = MODEL_FIELD) -> Any:
    """Load `entrypoint` and call it with `args` as keyword arguments.

    Raises:
        EntrypointError: `load`'s errors, or the call raised (its file and line).
    """
    builder = load(entrypoint, field=field)
    try:
        return builder(**dict(args))
    except Exception as exc:  # any error in the user's code
        if out_of_memory(exc):  # the machine's limit, not a mistake in the code: not permanent
            raise
        raise EntrypointError(_raised(f"{field}: {entrypoint}({_arg_list(args)})", exc)) from None


def build_model(entrypoint: str, args: Mapping[str, Any]) -> nn.Module:
    """The model `entrypoint(**args)` returns.

    Raises:
        EntrypointError: `call`'s errors, or it returned something other than an nn.Module.
    """
    model = call(entrypoint, args)
    if not isinstance(model, nn.Module):
        raise EntrypointError(
            f"{MODEL_FIELD}: {entrypoint} returned a {type(model).__module__}."
            f"{type(model).__qualname__}, not a torch.nn.Module; return the model itself")
    return model


def check_forward(model: nn.Module, sample: torch.Tensor, *, entrypoint: str,
                  language_model: bool) -> None:
    """Run one sample (no batch dimension) through a user's model and check its logits' shape:
    Tensor[1, K] for a classifier, Tensor[1, T, V] for a language model of input [T].

    Raises:
        EntrypointError: the forward pass raised (the user's file and line), returned no
            tensor, or logits of the wrong shape for spec.model.task.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            logits = model(sample.unsqueeze(0))
    except Exception as exc:  # noqa: BLE001  # any error in the user's forward
        raise EntrypointError(_raised(f"{MODEL_FIELD}: the forward pass of {entrypoint} on one "
                                      f"sample of shape {list(sample.shape)}", exc)) from None
    finally:
        model.train(was_training)
    if not isinstance(logits, torch.Tensor):
        raise EntrypointError(f"{MODEL_FIELD}: {entrypoint}'s model returned a "
                              f"{type(logits).__name__}, not a logits tensor; return the logits "
                              "(e.g. outputs.logits)")
    shape = list(logits.shape)
    if language_model and (len(shape) != 3 or shape[1] != sample.shape[-1]):
        raise EntrypointError(
            f"spec.model.task: a language_model returns next-token logits Tensor[B, T, V] for "
            f"input LongTensor[B, T] (got shape {shape} for input {[1, *sample.shape]}); fix "
            f"{entrypoint} or set task: classification")
    if not language_model and len(shape) != 2:
        raise EntrypointError(
            f"spec.model.task: a classification model returns logits Tensor[B, K] (got shape "
            f"{shape} for input {[1, *sample.shape]}); fix {entrypoint} or set task: "
            "language_model")


_MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory",
                 "not enough memory")
# Frames from these packages are never the user's line: the tail skips them.
_NOT_USER_CODE = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep
                       for m in (torch, importlib))


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is running out of memory: CUDA's OutOfMemoryError, Python's MemoryError,
    or an allocator's RuntimeError (the CPU's says "can't allocate memory")."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(words in text for words in _MEMORY_WORDS)


def traceback_tail(exc: BaseException) -> str:
    """The last frames of `exc`'s traceback in the user's code (not importlib, torch or this
    module), one line: ``file.py, line 12, in build: raise ValueError(...)`` (most recent
    first, `` <- `` joined)."""
    frames = traceback.extract_tb(exc.__traceback__)
    here = os.path.abspath(__file__)
    kept = [f for f in frames if not f.filename.startswith("<frozen")
            and os.path.abspath(f.filename) != here
            and not os.path.abspath(f.filename).startswith(_NOT_USER_CODE)]
    parts = [f"{_short_path(f.filename)}, line {f.lineno}, in {f.name}"
             + (f": {f.line.strip()}" if f.line else "") for f in kept[-TAIL_FRAMES:]]
    return " <- ".join(reversed(parts))


def _raised(what: str, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
    tail = traceback_tail(exc)
    return f"{what} raised {detail}" + (f" (at {tail})" if tail else "")


def _is_prefix(missing: str, module_name: str) -> bool:
    """Whether the missing module is `module_name` or one of its parent packages (the user's
    own module is not on the path), rather than something the user's module imports."""
    return module_name == missing or module_name.startswith(missing + ".")


def _short_path(path: str) -> str:
    """`path` relative to the working directory when under it, else as given."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def _arg_list(args: Mapping[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return text if len(text) <= 120 else text[:117] + "..."

