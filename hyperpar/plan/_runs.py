"""The real runs behind ``hyperpar plan --measure`` and the calibration: the example Llama
(``examples/llama``) laid out as a :class:`~hyperpar.plan.layout.Layout` with hyperpar's own
``parallelize_module`` (tensor + sequence parallel plan), ``fully_shard`` (every block, then the
root; HSDP on a ``(dp_replicate, dp_shard)`` mesh), ``data_parallel`` (``dp_replicate`` alone)
and ``PipelineModule`` + the 1F1B / GPipe schedules (``pp``), trained with AdamW. Context
parallelism (``cp``) runs ``context_parallel`` over ``mesh["cp"]`` and reduces its gradients with
the data-parallel ranks: ``data_parallel`` over the flattened ``dp_replicate x cp`` group, or,
with ``dp_shard > 1``, ``fully_shard`` over the flattened ``dp_shard x cp`` group (HSDP with
``dp_replicate``).

:func:`run_layout` runs inside one rank (spawned by :func:`hyperpar.testing.run_distributed`)
and returns that rank's figures. Imports torch (only when a run happens).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layout import Layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def _examples() -> Any:
    root = Path(__file__).resolve().parents[2]
    if (root / "examples" / "llama").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from examples.llama import model as llama

    return llama


def _on(device: str | None) -> Any:
    return torch.device(device) if device else contextlib.nullcontext()


class Embed(nn.Module):
    """Pipeline layer 0: the token embedding. ``device="meta"`` builds it without memory (the
    simulation backend)."""

    def __init__(self, args: Any, device: str | None = None) -> None:
        super().__init__()
        with _on(device):
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)


class Block(nn.Module):
    """A decoder layer that owns its rotary tables, so it is called as ``layer(h)``."""

    def __init__(self, args: Any, device: str | None = None) -> None:
        super().__init__()
        llama = _examples()
        with _on(device):
            self.block = llama.TransformerBlock(args)
            cos, sin = llama.rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h, self.cos, self.sin)


class Head(nn.Module):
    """The last pipeline layer: final norm and output projection."""

    def __init__(self, args: Any, device: str | None = None) -> None:
        super().__init__()
        llama = _examples()
        with _on(device):
            self.norm = llama.RMSNorm(args.dim, args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    loc = _local(t)
    return loc.numel() * loc.element_size()


def _checkpointed(block: nn.Module) -> None:
    """Recompute ``block`` in backward (non-reentrant torch.utils.checkpoint)."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    def run(*a: Any) -> Any:
        return checkpoint(forward, *a, use_reentrant=False)

    block.forward = run  # type: ignore[method-assign]


def pipeline(args: Any, mesh: Any, pp: int, device: str | None = None) -> nn.Module:
    """The example Llama as a ``PipelineModule`` over ``mesh["pp"]``: the embedding with the
    first ``n_layers / pp`` layers on stage 0, the final norm and head with the last layers on
    the last stage (the split the planner assumes)."""
    from hyperpar.pipeline import LayerSpec, PipelineModule

    per = args.n_layers // pp
    bounds = [0] + [1 + per * (s + 1) for s in range(pp - 1)] + [args.n_layers + 2]
    layers = ([LayerSpec(Embed, args, device)]
              + [LayerSpec(Block, args, device) for _ in range(args.n_layers)]
              + [LayerSpec(Head, args, device)])
    return PipelineModule(layers, mesh=mesh, mesh_dim="pp", loss_fn=_loss, seed_layers=True,
                          partition_method=bounds)


def shard_pipeline_ends(model: nn.Module, dp_mesh: Any) -> None:
    """A pipeline's schedule calls its layers, not the module's ``forward``, so the root unit's
    hooks never run: the embedding and head get their own fully_shard units, kept gathered from
    forward to backward as the root unit would be."""
    from hyperpar import fully_shard

    for m in model.modules():
        if isinstance(m, (Embed, Head)):
            fully_shard(m, mesh=dp_mesh, reshard_after_forward=False)


def build(sizes: dict[str, int], lay: Layout, seq_len: int, replicas: int = 1
          ) -> tuple[nn.Module, Any, Any]:
    """The laid-out model on this rank, its mesh, and (pp > 1) the pipeline schedule.
    ``replicas > 1``: the world holds that many independent copies of the layout (an outer
    mesh dim no parallelism uses; the calibration measures a group size below the world's)."""
    from hyperpar import fully_shard, init_device_mesh, parallelize_module
    from hyperpar.parallel import data_parallel

    llama = _examples()
    args = llama.ModelArgs(**{**sizes, "max_seq_len": seq_len})
    shape = tuple(lay.size(d) for d in MESH_DIMS)
    names = MESH_DIMS
    if replicas > 1:
        shape, names = (replicas, *shape), ("replica", *MESH_DIMS)
    mesh = init_device_mesh(shape, mesh_dim_names=names)
    schedule = None
    if lay.pp > 1:
        if lay.tp > 1:
            raise ValueError("hyperpar plan --measure: pp x tp is not measured (the example's "
                             "tensor-parallel plan is written for the whole Transformer)")
        model: nn.Module = pipeline(args, mesh, lay.pp)
        blocks = [m for m in model.modules() if isinstance(m, Block)]
    else:
        model = llama.build(args, seed=0)
        blocks = list(model.layers)
    if lay.activation_checkpointing:
        for b in blocks:
            _checkpointed(b)
    if lay.tp > 1:
        from examples.llama import plan as plans

        parallelize_module(model, mesh["tp"], plans.tp_sp_plan())
    if lay.cp > 1 and (lay.tp > 1 or lay.pp > 1):
        raise ValueError(f"hyperpar plan --measure: {lay.name}: cp is laid out with "
                         "dp_replicate and dp_shard only (tp = pp = 1)")
    if lay.dp_shard > 1:
        dp_mesh = fsdp_mesh(mesh, lay, replicas)
        shard_pipeline_ends(model, dp_mesh)
        for b in blocks:
            fully_shard(b, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    elif lay.cp > 1:
        # the cp ranks average their gradients with the replicas: one flattened group
        flat = mesh["dp_replicate", "cp"].flatten("dp_cp") if lay.dp_replicate > 1 else mesh
        model = data_parallel(model, flat, "dp_cp" if lay.dp_replicate > 1 else "cp")
    elif lay.dp_replicate > 1:
        model = data_parallel(model, mesh, "dp_replicate")
    if lay.pp > 1:
        from hyperpar.pipeline import get_schedule_class

        schedule = get_schedule_class(lay.schedule)(model, n_microbatches=lay.microbatches)
    return model, mesh, schedule


def fsdp_mesh(mesh: Any, lay: Layout, replicas: int = 1) -> Any:
    """The mesh ``fully_shard`` shards over: ``dp_shard``; with cp the flattened
    ``dp_shard x cp`` group (torchtitan's ``dp_shard_cp``: the cp ranks average their
    gradients with the shards); with ``dp_replicate`` too, 2-D ``(dp_replicate, shard)`` for
    HSDP. A mesh slice cannot mix a flattened dim with another, so HSDP x cp uses a second mesh
    over the same ranks whose dim ``dp_shard_cp`` is ``dp_shard x cp`` (row-major, as flatten
    walks it)."""
    from hyperpar import init_device_mesh

    if lay.cp == 1:
        return mesh["dp_replicate", "dp_shard"] if lay.dp_replicate > 1 else mesh["dp_shard"]
    if lay.dp_replicate == 1:
        return mesh["dp_shard", "cp"].flatten("dp_shard_cp")
    shape: tuple[int, ...] = (lay.pp, lay.dp_replicate, lay.dp_shard * lay.cp, lay.tp)
    names: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard_cp", "tp")
    if replicas > 1:
        shape, names = (replicas, *shape), ("replica", *names)
    return init_device_mesh(shape, mesh_dim_names=names)["dp_replicate", "dp_shard_cp"]


@contextlib.contextmanager
def _context(model: nn.Module, mesh: Any, lay: Layout, tokens: torch.Tensor,
             labels: torch.Tensor) -> Any:
    """Yield the microbatch's (tokens, labels): as given, or under ``cp > 1`` this rank's
    sequence shards inside ``context_parallel`` (the RoPE tables sharded with them)."""
    if lay.cp == 1:
        yield tokens, labels
        return
    from hyperpar.parallel import context_parallel

    tokens, labels = tokens.clone(), labels.clone()
    with context_parallel(mesh["cp"], buffers=[tokens, labels, model.rope_cos, model.rope_sin],
                          buffer_seq_dims=[1, 1, 0, 0]):
        yield tokens, labels


def run_layout(sizes: dict[str, int], layout: dict[str, Any], seq_len: int, global_batch: int,
               steps: int, warmup: int, peak: bool = True, alone: bool = False,
               replicas: int = 1) -> dict[str, float]:
    """Train ``steps`` timed steps (after ``warmup``) of the laid-out model on this rank.

    Returns ``states`` (bytes of local parameters + gradients + AdamW states), ``step_ms``,
    ``fb_ms`` (forward + backward of all microbatches) and ``opt_ms`` (optimizer step and
    ``zero_grad``), medians over the timed steps, ``stage`` (this rank's pipeline stage), and
    with ``peak`` the ``peak`` live tensor bytes of one more step (:class:`LiveBytes`).
    ``alone=True`` runs ``Layout()`` on every rank at once, without any communication (the
    ranks load the cores as a real run does); ``replicas > 1`` runs that many independent
    copies of the layout side by side (:func:`build`)."""
    from hyperpar.platform import get_platform

    from .live_bytes import LiveBytes

    pf = get_platform()
    lay = Layout(**layout)
    llama = _examples()
    args = llama.ModelArgs(**{**sizes, "max_seq_len": seq_len})
    if alone:
        model, mesh, schedule = llama.build(args, seed=0), None, None
        if lay.activation_checkpointing:
            for b in model.layers:
                _checkpointed(b)
        dp_rank, dp, stage = 0, 1, 0
    else:
        model, mesh, schedule = build(sizes, lay, seq_len, replicas)
        dp = lay.dp
        dp_rank = (mesh.get_local_rank("dp_replicate") * lay.dp_shard
                   + mesh.get_local_rank("dp_shard"))
        stage = mesh.get_local_rank("pp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per = global_batch // dp
    micro = per // lay.microbatches
    fb, op, total = [], [], []
    grad_bytes = [0]

    def one_step(step: int) -> tuple[float, float]:
        tokens, labels = llama.batch(args, batch_size=global_batch, seq_len=seq_len, seed=step)
        tokens = tokens[dp_rank * per:(dp_rank + 1) * per]
        labels = labels[dp_rank * per:(dp_rank + 1) * per]
        start = time.perf_counter()
        if schedule is not None and hasattr(model, "no_sync"):
            # data_parallel under a pipeline: accumulate, all-reduce once per step
            with model.no_sync():
                schedule.step(tokens, target=labels)
            model.finish_gradient_sync()
        elif schedule is not None:
            schedule.step(tokens, target=labels)
        else:
            for i in range(lay.microbatches):
                rows = slice(i * micro, (i + 1) * micro)
                last = i == lay.microbatches - 1
                sync = (model.no_sync() if hasattr(model, "no_sync") and not last
                        else contextlib.nullcontext())
                with sync, _context(model, mesh, lay, tokens[rows], labels[rows]) as (x, y):
                    loss = _loss(model(x), y)
                    (loss / lay.microbatches).backward()
        mid = time.perf_counter()
        opt.step()
        grad_bytes[0] = sum(_nbytes(p.grad) for p in model.parameters())
        opt.zero_grad()
        return mid - start, time.perf_counter() - mid

    for step in range(warmup + steps):
        pf.barrier()
        start = time.perf_counter()
        f, o = one_step(step)
        pf.barrier()
        if step >= warmup:
            fb.append(f)
            op.append(o)
            total.append(time.perf_counter() - start)
    params = list(model.parameters())
    states = sum(_nbytes(p) for p in params)
    states += grad_bytes[0]
    states += sum(_nbytes(v) for p in params for k, v in opt.state[p].items()
                  if k in ("exp_avg", "exp_avg_sq"))
    out = {"states": float(states), "step_ms": statistics.median(total) * 1e3,
           "fb_ms": statistics.median(fb) * 1e3, "opt_ms": statistics.median(op) * 1e3,
           "stage": float(stage)}
    if peak:
        pf.barrier()
        with LiveBytes() as lb:
            lb.track(params)
            lb.track(v for p in params for v in opt.state[p].values())
            one_step(warmup + steps)
        out["peak"] = float(lb.peak)
        pf.barrier()
    return out
