"""``PipelineEngine`` / ``initialize``: DeepSpeed's pipeline training loop over hyperpar's
schedules.

``train_batch(data_iter)`` draws ``gradient_accumulation_steps`` microbatches ``(inputs,
labels)`` from the iterator (on the ranks holding the first and the last stage), runs them
through a schedule (1F1B by default; the executors of :mod:`hyperpar.pipeline.executor` do all
the work), averages gradients over the data-parallel replicas, steps the optimizer (gradient
clipping; fp16 dynamic loss scaling with fp32 master weights; bf16 master weights) and
returns the mean microbatch loss, averaged over the replicas, on every stage.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from hyperpar.platform import get_platform

from ._faults import pipeline_step
from .config import EngineConfig, build_optimizer
from .executor import PipelineSchedule, get_schedule_class
from .module import PipelineModule
from .precision import DynamicLossScaler, MasterWeights, has_overflow

__all__ = ["PipelineEngine", "RepeatingLoader", "initialize"]


class DataExhaustedError(StopIteration):
    """The data iterator ran out in the middle of a batch. A ``StopIteration`` (loops that end
    on it keep working) whose message says how many microbatches were drawn and what to do."""


class RepeatingLoader:
    """Iterate ``loader`` forever, restarting it when it is exhausted (DeepSpeed's
    ``deepspeed.utils.RepeatingLoader``)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


class PipelineEngine:
    """Train a :class:`PipelineModule` the DeepSpeed way; see the module docstring.

    ``PipelineEngine(model, optimizer=None, config=..., *, model_parameters=None,
    lr_scheduler=None, training_data=None, collate_fn=None, schedule=None)``. ``optimizer`` is
    a ``torch.optim`` optimizer over this stage's parameters, a callable ``params ->
    optimizer``, or ``None`` to build the config's ``"optimizer"``. ``schedule`` is a schedule
    class or name (default ``"1f1b"``, interleaved for ``virtual_stages > 1``).
    """

    def __init__(self, model: PipelineModule, optimizer: Any = None,
                 config: Mapping[str, Any] | str | os.PathLike | None = None, *,
                 model_parameters: Iterable[torch.Tensor] | None = None,
                 lr_scheduler: Any = None, training_data: Any = None, collate_fn: Any = None,
                 schedule: type[PipelineSchedule] | str | None = None) -> None:
        if not isinstance(model, PipelineModule):
            raise TypeError(f"PipelineEngine trains a hyperpar PipelineModule, got "
                            f"{type(model).__name__}; build the model with "
                            f"PipelineModule(layers=..., loss_fn=...)")
        self.config = cfg = EngineConfig.from_any(config, model.dp_size)
        if optimizer is not None and cfg.optimizer is not None:
            raise ValueError("PipelineEngine: an optimizer was passed and the config has an "
                             "'optimizer' section; give only one")
        if optimizer is None and cfg.optimizer is None:
            raise ValueError("PipelineEngine: no optimizer: pass optimizer= or put "
                             "{'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}}} in the "
                             "config")
        self.module = model
        self.platform = get_platform()
        # clip_grad_norm_ reads pp_group=None as "one stage": name the world explicitly
        self._pp_group = model.group
        if model.group is None and model.num_stages > 1:
            self._pp_group = self.platform.new_group(model.stage_ranks)
        if cfg.activation_checkpoint_interval:
            model.activation_checkpoint_interval = cfg.activation_checkpoint_interval
        self.masters: MasterWeights | None = None
        if cfg.dtype != torch.float32:   # fp32 copies first, then the model goes half
            self.masters = MasterWeights(list(model.parameters()))
            model.to(cfg.dtype)
        self.optimizer = self._make_optimizer(optimizer, model_parameters)
        self.lr_scheduler = lr_scheduler
        self.scaler = DynamicLossScaler(cfg.fp16) if cfg.dtype == torch.float16 else None
        if schedule is None:
            schedule = "interleaved1f1b" if model.virtual_stages > 1 else "1f1b"
        self._schedule_cls = (get_schedule_class(schedule) if isinstance(schedule, str)
                              else schedule)
        self._schedules: dict[int, PipelineSchedule] = {}
        self.global_steps = 0
        self.global_samples = 0
        self._global_grad_norm: float | None = None
        self.batch_fn: Any = None
        self.data_iterator: Iterator[Any] | None = None
        self.training_dataloader = (self._data_loader(training_data, collate_fn)
                                    if training_data is not None else None)
        if self.training_dataloader is not None:
            self.data_iterator = iter(RepeatingLoader(self.training_dataloader))

    # ------------------------------------------------------------------ DeepSpeed accessors
    @property
    def stage_id(self) -> int:
        return self.module.stage_id

    @property
    def num_stages(self) -> int:
        return self.module.num_stages

    @property
    def dp_world_size(self) -> int:
        return self.module.dp_size

    def is_first_stage(self) -> bool:
        return 0 in self.module.local_stages

    def is_last_stage(self) -> bool:
        return self.module.total_stages - 1 in self.module.local_stages

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last step (computed when clipping is on)."""
        return self._global_grad_norm

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Any) -> None:
        """Post-process every drawn microbatch with ``fn(batch)`` (DeepSpeed's hook)."""
        self.batch_fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("PipelineEngine: only train_batch() and eval_batch() run a pipeline "
                           "(as in DeepSpeed); forward/backward/step are not available")

    backward = step = __call__ = forward

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("PipelineEngine.save_checkpoint: use hyperpar.checkpoint "
                                  "(save(engine.module.state_dict(), path)) instead")

    load_checkpoint = save_checkpoint

    # ------------------------------------------------------------------ training
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``train_batch_size`` samples (``gradient_accumulation_steps``
        microbatches per pipeline). Returns the mean microbatch loss, averaged over the
        data-parallel replicas, on every stage (a float32 scalar tensor)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() "
                               "instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        m = self.config.gradient_accumulation_steps
        losses: list[torch.Tensor] = []
        # One pipeline step: a rank failing here (data, a stage) is named on the other ranks.
        with pipeline_step(self.module):
            inputs, targets = self._draw(self.data_iterator, m, "train_batch")
            self.module.train()
            schedule = self._schedule(m)
            schedule.grad_scale = self.loss_scale
            with self._no_dp_sync():
                schedule.run_microbatches(inputs, targets, train=True, losses=losses)
        self._reduce_gradients()
        self._optimizer_step()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        return self._aggregate(losses, broadcast=True)

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: str | None = "avg",
                   bcast_loss: bool = True, num_micro_batches: int | None = None) -> Any:
        """Forward ``num_micro_batches`` (default: ``gradient_accumulation_steps``)
        microbatches without gradients. Returns the loss as :meth:`train_batch` does
        (``reduce_output=None``: the list of microbatch losses, last stage only;
        ``bcast_loss=False``: on the last stage only), and with ``return_logits=True``
        ``(loss, logits)`` where ``logits`` are the model outputs of all the microbatches
        concatenated along dim 0 on the last stage (``None`` elsewhere)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got "
                             f"{reduce_output!r}")
        m = num_micro_batches or self.config.gradient_accumulation_steps
        losses: list[torch.Tensor] = []
        with pipeline_step(self.module):
            inputs, targets = self._draw(data_iter, m, "eval_batch")
            self.module.eval()
            result = self._schedule(m).run_microbatches(
                inputs, targets if compute_loss else None, train=False, losses=losses,
                return_outputs=return_logits)
        logits = result[1] if return_logits and result is not None else None
        loss: Any = None
        if compute_loss and reduce_output is None:
            loss = [x.float() for x in losses] if self.is_last_stage() else None
        elif compute_loss:
            loss = self._aggregate(losses, broadcast=bcast_loss)
        return (loss, logits) if return_logits else loss

    # ------------------------------------------------------------------ steps
    def _make_optimizer(self, optimizer: Any, model_parameters: Any) -> torch.optim.Optimizer:
        if optimizer is None:
            params = (self.masters.masters if self.masters is not None else
                      [p for p in (model_parameters if model_parameters is not None
                                   else self.module.parameters()) if p.requires_grad])
            return build_optimizer(self.config.optimizer or {}, params)
        if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
            optimizer = optimizer(model_parameters if model_parameters is not None
                                  else self.module.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"PipelineEngine: optimizer must be a torch.optim.Optimizer or a "
                            f"callable returning one, got {type(optimizer).__name__}")
        if self.masters is not None:
            self.masters.adopt(optimizer)
        return optimizer

    def _schedule(self, m: int) -> PipelineSchedule:
        if m not in self._schedules:
            loss_fn = self.module.loss_fn
            if loss_fn is None:   # the model's last layer returns the loss (DeepSpeed)
                def loss_fn(out: Any, *_: Any) -> Any:
                    return out
            self._schedules[m] = self._schedule_cls(self.module, m, loss_fn=loss_fn)
        return self._schedules[m]

    def _draw(self, it: Iterator[Any] | None, m: int, where: str) -> tuple[Any, Any]:
        """``m`` microbatches from ``it`` on the ranks that need data (first/last stage)."""
        first, last = self.is_first_stage(), self.is_last_stage()
        if not (first or last):
            return None, None
        if it is None:
            raise ValueError(f"{where}: no data iterator; pass data_iter= (needed on the ranks "
                             f"holding the first and the last stage)")
        if not hasattr(it, "__next__"):
            it = iter(it)
            self.data_iterator = it if where == "train_batch" else self.data_iterator
        device, dtype = self.platform.device(), self.config.dtype
        inputs, targets = [], []
        for i in range(m):
            try:
                batch = next(it)
            except StopIteration:
                raise DataExhaustedError(
                    f"{where}: the data iterator ran out after {i} of the {m} microbatches "
                    f"this step needs (gradient_accumulation_steps={m}); give a longer "
                    f"iterator, wrap the loader in hyperpar.pipeline.engine.RepeatingLoader, or "
                    f"stop calling {where}() when it is exhausted") from None
            if self.batch_fn is not None:
                batch = self.batch_fn(batch)
            if not (isinstance(batch, tuple | list) and len(batch) == 2):
                raise TypeError(f"{where}: each item of the data iterator must be a pair "
                                f"(inputs, labels), got {type(batch).__name__}")
            inputs.append(_to(batch[0], device, dtype) if first else None)
            targets.append(_to(batch[1], device, None) if last else None)
        return (inputs if first else None), (targets if last else None)

    @contextlib.contextmanager
    def _no_dp_sync(self) -> Iterator[None]:
        """Let a data-parallel or fully_shard wrapper accumulate the microbatches' gradients
        locally; :meth:`_reduce_gradients` reduces them once."""
        mod: Any = self.module
        if hasattr(mod, "no_sync") and hasattr(mod, "sync_gradients"):
            with mod.no_sync():
                yield
        elif hasattr(mod, "set_requires_gradient_sync"):
            mod.set_requires_gradient_sync(False)
            yield
        else:
            yield

    def _reduce_gradients(self) -> None:
        mod: Any = self.module
        if hasattr(mod, "sync_gradients"):   # data_parallel / fully_shard do it their way
            mod.sync_gradients()
            return
        if mod.dp_size == 1:
            return
        for p in mod.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:   # keep the collectives paired across replicas
                p.grad = torch.zeros_like(p)
            g = p.grad
            local = g.to_local() if hasattr(g, "placements") else g
            self.platform.all_reduce(local, "avg", group=mod.dp_group)

    def _optimizer_step(self) -> None:
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        scale = self.loss_scale   # the scale this step's loss was multiplied by
        if self.scaler is not None:
            flag = torch.tensor([1.0 if has_overflow(trainable) else 0.0],
                                device=self.platform.device())
            self.platform.all_reduce(flag, "max")   # every rank skips together
            overflow = bool(flag.item())
            self.scaler.update(overflow)
            if overflow:
                for p in trainable:
                    p.grad = None
                return
        if self.masters is not None:
            self.masters.grads_to_masters(1.0 / scale)
            stepped = self.masters.masters
        else:
            stepped = trainable
        if self.config.gradient_clipping > 0:
            self._clip(stepped)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.masters_to_model()
        else:
            for p in trainable:
                p.grad = None
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _clip(self, stepped: list[torch.Tensor]) -> None:
        """Clip by the norm of the whole model's gradients: every stage's, a tied weight
        counted once (on its first owning stage), replicas not double counted."""
        from hyperpar.fsdp.clip import clip_grad_norm_

        mod = self.module
        duplicate = {id(p) for key, owners in mod.tied_owners.items()
                     if key in mod.tied_modules and owners[0] != mod.stage_id
                     for p in mod.tied_modules[key].parameters()}
        trainable = [p for p in mod.parameters() if p.requires_grad]
        pairs = list(zip(stepped, trainable, strict=True))
        counted = [s for s, p in pairs if id(p) not in duplicate]
        clip = self.config.gradient_clipping
        norm = float(clip_grad_norm_(counted, clip,
                                     pp_group=self._pp_group if mod.num_stages > 1 else None))
        self._global_grad_norm = norm
        coef = min(1.0, clip / (norm + 1e-6))   # the factor clip_grad_norm_ applied
        for s, p in pairs:
            if id(p) in duplicate and s.grad is not None and coef < 1.0:
                s.grad.mul_(coef)

    def _aggregate(self, losses: list[torch.Tensor], broadcast: bool) -> Any:
        """Mean of the microbatch losses, averaged over replicas, sent to every stage."""
        mod, device = self.module, self.platform.device()
        loss = None
        if self.is_last_stage():
            loss = torch.stack([x.detach().float() for x in losses]).mean().to(device)
            if mod.dp_size > 1:
                self.platform.all_reduce(loss, "avg", group=mod.dp_group)
        if not broadcast or mod.num_stages == 1:
            return loss
        buf = loss.reshape(1).clone() if loss is not None else torch.zeros(1, device=device)
        owner = mod.stage_owner(mod.total_stages - 1)
        self.platform.broadcast(buf, src=mod.stage_ranks[owner], group=mod.group)
        return buf[0]

    def _data_loader(self, dataset: Any, collate_fn: Any) -> Any:
        from torch.utils.data import DataLoader, DistributedSampler

        mod = self.module
        dp_rank = self.platform.rank(mod.dp_group) if mod.dp_size > 1 else 0
        sampler = DistributedSampler(dataset, num_replicas=mod.dp_size, rank=dp_rank,
                                     shuffle=False)
        return DataLoader(dataset, batch_size=self.config.micro_batch_size, sampler=sampler,
                          collate_fn=collate_fn)


def _to(value: Any, device: Any, dtype: torch.dtype | None) -> Any:
    """Move tensors to ``device``; floating inputs take the engine's half dtype."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        if dtype is not None and dtype != torch.float32 and value.is_floating_point():
            value = value.to(dtype)
        return value
    if isinstance(value, tuple | list):
        return tuple(_to(v, device, dtype) for v in value)
    return value


def initialize(args: Any = None, model: PipelineModule | None = None, optimizer: Any = None,
               model_parameters: Iterable[torch.Tensor] | None = None,
               training_data: Any = None, lr_scheduler: Any = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None,
               config: Mapping[str, Any] | str | None = None,
               config_params: Mapping[str, Any] | None = None) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` for pipelines: returns ``(engine, optimizer,
    training_dataloader, lr_scheduler)``. ``config`` (or ``config_params``, or
    ``args.deepspeed_config``) is a dict or a JSON path. The process group must already be up
    (``hyperpar.init_process_group()`` / ``hyperpar run``); ``mpu`` is not supported (give the
    PipelineModule a ``topology`` or a ``mesh``)."""
    del dist_init_required
    if mpu is not None:
        raise ValueError("initialize: mpu= is not supported; build the PipelineModule with "
                         "topology=PipeModelDataParallelTopology(...) or mesh= instead")
    if model is None:
        raise ValueError("initialize: model= (a PipelineModule) is required")
    if config is None:
        config = config_params if config_params is not None else \
            getattr(args, "deepspeed_config", None)
    engine = PipelineEngine(model, optimizer, config, model_parameters=model_parameters,
                            lr_scheduler=lr_scheduler, training_data=training_data,
                            collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
