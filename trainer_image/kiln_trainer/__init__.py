"""kiln_trainer: Kiln's trainer, as the default entrypoint and as a library.

``python -m kiln_trainer --job job.yaml`` trains one TrainingJob (`loop.main`); as a library, a
few calls add Kiln's checkpoints and metrics to your own loop. Importing this package never
imports kopf, kubernetes or pyomo.

    >>> import tempfile, torch, kiln_trainer
    >>> from kiln.zoo import store
    >>> model = torch.nn.Linear(4, 2)
    >>> where = kiln_trainer.checkpoint.Location(store.DirStore(tempfile.mkdtemp()), "job.pt")
    >>> reporter = kiln_trainer.MetricsReporter(job="my-job")      # .serve(9090) to expose
    >>> reporter.record_validation(accuracy=0.91, loss=0.3)
    >>> size_bytes = kiln_trainer.save_checkpoint(where, {"model": model.state_dict(), "epoch": 1})
    >>> kiln_trainer.load_checkpoint(where)["epoch"]
    1
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
}
_SUBMODULES = {"checkpoint", "cli", "data", "distributed", "events", "freezing", "loop", "metrics",
               "optim", "registration", "runtime", "tracking", "warm"}

__all__ = ["DatasetError", "MetricsReporter", "load_checkpoint", "run", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module), attribute)
    if name in _SUBMODULES:
        return importlib.import_module(f"kiln_trainer.{name}")
    raise AttributeError(f"module 'kiln_trainer' has no attribute {name!r}")
