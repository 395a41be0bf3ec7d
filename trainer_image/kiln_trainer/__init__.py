"""kiln_trainer: Kiln's trainer, as the default entrypoint and as a library.

``python -m kiln_trainer --job job.yaml`` trains one TrainingJob (`loop.main`); as a library,
`job_context` gives your own loop Kiln's warm start, freezing, mixed precision, progress,
checkpoints and zoo registration (`jobcontext`). Importing it never imports kopf, kubernetes or
pyomo. Your loop, with Kiln's lines marked:

    >>> import io, json, tempfile, torch, kiln_trainer
    >>> job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "a"},
    ...        "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]}}}
    >>> env = {"KILN_JOB": json.dumps(job), "KILN_CHECKPOINTS": tempfile.mkdtemp()}
    >>> model = torch.nn.Linear(4, 2); optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> ctx = kiln_trainer.job_context(environ=env, out=io.StringIO())  # Kiln (a pod: no args)
    >>> report = ctx.warm_start(model)  # Kiln: the zoo parent's weights, if any
    >>> epoch = ctx.resume(model, optimizer, steps_per_epoch=1)  # Kiln: 0, or the checkpoint's
    >>> with ctx.amp.autocast(): loss = model(torch.randn(8, 4)).square().mean()
    >>> ctx.amp.backward(loss); optimizer.step(); ctx.trained(loss, samples=8)  # Kiln: progress
    >>> done = ctx.evaluated(accuracy=0.9, loss=0.3)  # Kiln: target, time-to-target, history
    >>> ctx.finish(model).validation_accuracy  # Kiln: zoo registration and the result
    0.9
"""

import importlib
from typing import Any

# Root exports resolve on first use (PEP 562): the freezing reference process imports
# `kiln_trainer.freezing.reference` and should not pay for the whole trainer (data loaders,
# zoo, warm start) on every start.
_EXPORTS = {
    "run": ("kiln_trainer.loop", "main"),
    "save_checkpoint": ("kiln_trainer.checkpoint", "save_checkpoint"),
    "load_checkpoint": ("kiln_trainer.checkpoint", "load_checkpoint"),
    "MetricsReporter": ("kiln_trainer.metrics", "MetricsReporter"),
    "DatasetError": ("kiln_trainer.data", "DatasetError"),
    "job_context": ("kiln_trainer.jobcontext", "job_context"),
    "JobContext": ("kiln_trainer.jobcontext", "JobContext"),
    "MixedPrecision": ("kiln_trainer.precision", "MixedPrecision"),
}
_SUBMODULES = {"checkpoint", "cli", "data", "distributed", "events", "freezing", "jobcontext",
               "loop", "metrics", "optim", "precision", "registration", "runtime", "tracking",
               "warm"}

__all__ = ["DatasetError", "JobContext", "MetricsReporter", "MixedPrecision", "job_context",
           "load_checkpoint", "run", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module), attribute)
    if name in _SUBMODULES:
        return importlib.import_module(f"kiln_trainer.{name}")
    raise AttributeError(f"module 'kiln_trainer' has no attribute {name!r}")
