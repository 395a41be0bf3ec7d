"""`KilnCallback`: Kiln's warm start, resume, freezing, progress and zoo registration for a
Hugging Face `transformers.Trainer`, through the same `JobContext` an own loop uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils import hooks

from kiln_trainer.freezing import controller as freezing
from kiln_trainer.integrations import common
from kiln_trainer.jobcontext import JobContext, job_context


# mypy does not analyse transformers (pyproject.toml: its cost), so the base class is Any.
class KilnCallback(transformers.TrainerCallback):  # type: ignore[misc]
    """Add to ``Trainer(callbacks=[...])``; `training_arguments` gives the job's settings.

    * at the start of training: the zoo parent's weights into the model (`JobContext.warm_start`),
      then the job's checkpoint into model, optimizer and schedule (`JobContext.resume`), then
      the layer freezer (`JobContext.freezer`) on the first training samples;
    * per optimizer step: the step's mean training loss and samples (`JobContext.trained`),
      which drives freezing and checkpoints on a stop signal;
    * per evaluation: accuracy and loss (`JobContext.evaluated`) and a checkpoint; training
      stops when the job is done (epoch budget, or target with ``stopAtTarget``);
    * at the end: the model registered in the zoo and the result written (`JobContext.finish`).

    A resumed run trains the epochs left: the Trainer's step count starts at the epochs done
    (a checkpoint taken mid-epoch starts that epoch over), so its ``max_steps`` ends it.

    Args:
        ctx: the job's context (default `job_context()`, from the ``KILN_*`` environment).
        accuracy_key: the evaluation metric that is the validation accuracy in [0, 1]
            (``compute_metrics`` returning ``{"accuracy": ...}`` gives ``eval_accuracy``).
        loss_key: the evaluation metric that is the mean validation loss.
    """

    def __init__(self, ctx: JobContext | None = None, *, accuracy_key: str = "eval_accuracy",
                 loss_key: str = "eval_loss") -> None:
        self.ctx = ctx if ctx is not None else job_context()
        self.accuracy_key, self.loss_key = accuracy_key, loss_key
        self.steps_per_epoch = 0
        self._hook: hooks.RemovableHandle | None = None
        self._losses: list[float] = []  # this optimizer step's micro-batch losses
        self._samples = 0
        self._finished = False
        self._freezer: freezing.Freezer | None = None

    def training_arguments(self, output_dir: str, **overrides: Any) -> transformers.TrainingArguments:
        """`TrainingArguments` from the job's ``spec.training``: epochs, batch size, learning
        rate, weight decay, seed, precision and device; evaluation every epoch; the Trainer's
        own checkpoints off (Kiln keeps the job's). `overrides` win."""
        training = self.ctx.job.spec.training
        precision = str(getattr(training.precision, "value", training.precision))
        settings: dict[str, Any] = {
            "output_dir": output_dir, "num_train_epochs": training.epochs,
            "per_device_train_batch_size": training.batch_size,
            "per_device_eval_batch_size": training.batch_size,
            "learning_rate": training.optimizer.lr,
            "weight_decay": training.optimizer.weight_decay or 0.0,
            "seed": training.seed, "bf16": precision == "bf16", "fp16": precision == "fp16",
            "use_cpu": self.ctx.device.type == "cpu", "eval_strategy": "epoch",
            "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        }
        return transformers.TrainingArguments(**(settings | overrides))

    # -- the Trainer's events ----------------------------------------------------------------

    def on_train_begin(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                       control: transformers.TrainerControl, **kwargs: Any) -> None:
        """Warm start, resume and the freezer; `kwargs` are the Trainer's model, optimizer,
        lr_scheduler and train_dataloader."""
        model: nn.Module = kwargs["model"]
        optimizer: torch.optim.Optimizer = kwargs["optimizer"]
        train_dataloader = kwargs["train_dataloader"]
        ctx = self.ctx
        if str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "no":
            common.refuse(ctx, "KilnCallback: TrainingArguments.eval_strategy is 'no'; Kiln needs an "
                    "evaluation per epoch (eval_strategy='epoch' and an eval_dataset)")
        self.steps_per_epoch = max(-(-len(train_dataloader) // args.gradient_accumulation_steps), 1)
        ctx.warm_start(model)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds it
        epochs_done = ctx.resume(model, inner, steps_per_epoch=self.steps_per_epoch,
                                 scheduler=kwargs.get("lr_scheduler"))
        state.global_step = epochs_done * self.steps_per_epoch
        self._freezer = ctx.freezer(model, _probe(model, train_dataloader,
                                                  ctx.job.spec.freezing.probe_batch_size))
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)

    def on_optimizer_step(self, args: transformers.TrainingArguments,
                          state: transformers.TrainerState, control: transformers.TrainerControl,
                          **_: Any) -> None:
        """The step's gradients to the freezer before the Trainer zeroes them."""
        if self._freezer is not None:
            self._freezer.record_gradients()

    def on_step_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, **_: Any) -> None:
        """The optimizer step's mean micro-batch loss and its samples to `JobContext.trained`."""
        if not self._losses:
            common.refuse(self.ctx, "KilnCallback: the model's forward returned no loss; pass labels "
                    "in each batch and return {'loss': ..., 'logits': ...} (or a ModelOutput)")
        loss = sum(self._losses) / len(self._losses)
        samples, self._losses, self._samples = self._samples, [], 0
        self.ctx.trained(loss, samples=samples)

    def on_evaluate(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, metrics: Mapping[str, float] | None = None,
                    **_: Any) -> None:
        """An evaluation during training to `JobContext.evaluated`, then a checkpoint; stops
        the Trainer when the job is done."""
        if self._finished or self._hook is None or self.ctx.state.step == 0:
            return  # an evaluation before training or after it: no run to record it in
        try:
            accuracy, loss = common.evaluation(metrics or {}, self.accuracy_key, self.loss_key)
        except ValueError as exc:
            common.refuse(self.ctx, f"{exc} (the Trainer's: compute_metrics returning "
                          "{'accuracy': ...} gives eval_accuracy)")
        epoch_end = epoch_ended(state.global_step, self.steps_per_epoch,
                                self.ctx.state.epochs_done)
        if self.ctx.evaluated(accuracy=accuracy, loss=loss, epoch_end=epoch_end):
            control.should_training_stop = True
        self.ctx.checkpoint()

    def on_train_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                     control: transformers.TrainerControl, **kwargs: Any) -> None:
        """Register the Trainer's model (`kwargs`' model) and write the result."""
        model: nn.Module = kwargs["model"]
        if self._hook is not None:
            self._hook.remove()
        self._finished = True
        self.ctx.finish(model)

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    output: Any) -> None:
        """Keep a training forward's loss and batch size (evaluation runs without grad)."""
        if not (module.training and torch.is_grad_enabled()):
            return
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if isinstance(loss, torch.Tensor):
            self._losses.append(float(loss.detach()))
        self._samples += common.batch_size((*args, *kwargs.values()))


def epoch_ended(global_step: int, steps_per_epoch: int, epochs_done: int) -> bool:
    """Whether an evaluation at the Trainer's `global_step` closes an epoch not yet counted."""
    return (global_step > 0 and global_step % steps_per_epoch == 0
            and global_step // steps_per_epoch > epochs_done)


def _probe(model: nn.Module, loader: Any, samples: int) -> torch.Tensor:
    """The freezer's fixed probe: the model inputs (``model.main_input_name``, e.g. input_ids)
    of the first `samples` training samples."""
    inputs = common.first_samples(loader, samples)[getattr(model, "main_input_name", "input_ids")]
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(f"KilnCallback: the training batches' model input is a "
                        f"{type(inputs).__name__}, not a tensor")
    return inputs
