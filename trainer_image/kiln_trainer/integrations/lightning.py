"""`KilnCallback`: Kiln's warm start, resume, freezing, progress and zoo registration for a
PyTorch Lightning `Trainer`, through the same `JobContext` an own loop uses.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import exceptions

from kiln import api
from kiln_trainer.integrations import common
from kiln_trainer.jobcontext import Interrupted, JobContext, job_context

_PRECISION = {api.Precision.FP32: "32-true", api.Precision.BF16: "bf16-mixed",
              api.Precision.FP16: "16-mixed"}


class KilnCallback(pl.Callback):
    """Add to ``pl.Trainer(callbacks=[...])``; `trainer_arguments` gives the job's settings.

    * when fitting starts: the zoo parent's weights into the module (`JobContext.warm_start`);
    * when training starts: the job's checkpoint into module, optimizer and schedule
      (`JobContext.resume`), the epochs done skipped, and the layer freezer
      (`JobContext.freezer`) on the first training samples' inputs;
    * per optimizer step: its mean training loss and samples (`JobContext.trained`);
    * per validation: accuracy and loss from the logged metrics (`JobContext.evaluated`) and a
      checkpoint; the Trainer stops when the job is done;
    * when fitting ends: the module registered in the zoo and the result written.

    One optimizer (the first of ``configure_optimizers``) and one process.

    Args:
        ctx: the job's context (default `job_context()`, from the ``KILN_*`` environment).
        accuracy_key: the logged metric that is the validation accuracy in [0, 1].
        loss_key: the logged metric that is the mean validation loss.
    """

    def __init__(self, ctx: JobContext | None = None, *, accuracy_key: str = "val_accuracy",
                 loss_key: str = "val_loss") -> None:
        self.ctx = ctx if ctx is not None else job_context()
        self.accuracy_key, self.loss_key = accuracy_key, loss_key
        self.steps_per_epoch = 0
        self._losses: list[float] = []  # this optimizer step's micro-batch losses
        self._samples = 0

    def trainer_arguments(self, **overrides: Any) -> dict[str, Any]:
        """``pl.Trainer`` keyword arguments from the job's ``spec.training``: epochs, precision
        and device; Lightning's own checkpoints, logger and progress bar off (Kiln reports and
        keeps the job's checkpoint). `overrides` win."""
        training = self.ctx.job.spec.training
        return {"max_epochs": training.epochs, "precision": _PRECISION[training.precision],
                "accelerator": "cpu" if self.ctx.device.type == "cpu" else "gpu", "devices": 1,
                "enable_checkpointing": False, "logger": False, "enable_progress_bar": False,
                "enable_model_summary": False} | overrides

    # -- Lightning's hooks ---------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ctx.warm_start(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ctx = self.ctx
        batches = int(trainer.num_training_batches)
        self.steps_per_epoch = max(-(-batches // trainer.accumulate_grad_batches), 1)
        schedules = trainer.lr_scheduler_configs
        epochs_done = ctx.resume(pl_module, trainer.optimizers[0],
                                 steps_per_epoch=self.steps_per_epoch,
                                 scheduler=schedules[0].scheduler if schedules else None)
        progress = trainer.fit_loop.epoch_progress  # the loop runs the epochs left
        for _ in range(epochs_done):
            progress.increment_ready()
            progress.increment_started()
            progress.increment_processed()
            progress.increment_completed()
        probe = common.first_samples(trainer.train_dataloader,
                                     ctx.job.spec.freezing.probe_batch_size)
        inputs = probe[0] if isinstance(probe, tuple | list) else probe
        if not isinstance(inputs, torch.Tensor):
            common.refuse(ctx, "KilnCallback: a training batch is (inputs, targets) with inputs "
                          f"a tensor, not {type(inputs).__name__}")
        ctx.freezer(pl_module, inputs.to(pl_module.device))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, torch.Tensor):
            common.refuse(self.ctx, "KilnCallback: training_step returned no loss; return the "
                          "loss tensor (or {'loss': ...})")
        self._losses.append(float(loss.detach()))
        self._samples += common.batch_size(batch)
        last = batch_idx + 1 == trainer.num_training_batches
        if (batch_idx + 1) % trainer.accumulate_grad_batches and not last:
            return  # a micro-batch: the optimizer steps after the last of them
        loss_mean = sum(self._losses) / len(self._losses)
        samples, self._losses, self._samples = self._samples, [], 0
        self.ctx.trained(loss_mean, samples=samples)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.ctx.state.step == 0:
            return  # before training: no run to record it in
        try:
            accuracy, loss = common.evaluation(trainer.callback_metrics, self.accuracy_key,
                                               self.loss_key)
        except ValueError as exc:
            common.refuse(self.ctx, f"{exc} (Lightning's: self.log('val_accuracy', ...) and "
                          "self.log('val_loss', ...) in validation_step)")
        epoch_end = self.ctx.state.epoch_batch >= self.steps_per_epoch
        if self.ctx.evaluated(accuracy=accuracy, loss=loss, epoch_end=epoch_end):
            trainer.should_stop = True
        self.ctx.checkpoint()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ctx.finish(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Lightning stops on SIGTERM between steps: checkpoint there, as `JobContext.trained`
        does at a step, and exit 128 + the signal."""
        if not (isinstance(exception, exceptions.SIGTERMException) and self.ctx.stop.is_set()):
            return
        try:
            self.ctx.interrupt()
        except Interrupted:
            self.ctx.close()
            raise SystemExit(128 + signal.SIGTERM) from None
