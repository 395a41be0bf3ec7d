"""kiln_trainer: Kiln's trainer, as the default entrypoint and as a library.

As an entrypoint, ``python -m kiln_trainer --job job.yaml`` trains one TrainingJob (see
`kiln_trainer.cli`): seed, data, model, schedule, resume, epochs, zoo registration, with
JSON-lines progress on stdout and Prometheus metrics.

As a library, a few calls add Kiln's checkpoints and metrics to your own loop:

    >>> import tempfile, torch, kiln_trainer
    >>> from kiln.zoo import store
    >>> model = torch.nn.Linear(4, 2)
    >>> where = kiln_trainer.checkpoint.Location(store.DirStore(tempfile.mkdtemp()), "job.pt")
    >>> reporter = kiln_trainer.MetricsReporter(job="my-job")      # .serve(9090) to expose
    >>> reporter.record_validation(accuracy=0.91, loss=0.3)
    >>> size_bytes = kiln_trainer.save_checkpoint(where, {"model": model.state_dict(), "epoch": 1})
    >>> kiln_trainer.load_checkpoint(where)["epoch"]
    1

Root exports (`__all__`): `run` (the default recipe, `loop.main`), `save_checkpoint`,
`load_checkpoint`, `MetricsReporter`, `DatasetError`. Submodules: `data`, `loop`,
`checkpoint`, `metrics`, `optim`, `events`, `tracking`, `cli`.

Importing this package never imports kopf, kubernetes or pyomo.
"""

from kiln_trainer import loop
from kiln_trainer.checkpoint import load_checkpoint, save_checkpoint
from kiln_trainer.data import DatasetError
from kiln_trainer.metrics import MetricsReporter

run = loop.main

__all__ = ["DatasetError", "MetricsReporter", "load_checkpoint", "run", "save_checkpoint"]
