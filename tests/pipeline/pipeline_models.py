"""Models and the parity runner shared by the pipeline tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.pipeline import LayerSpec, PipelineModule, TiedLayerSpec, get_schedule_class
from hyperpar.testing import assert_close_to_reference

VOCAB, DIM, BATCH, SEQ = 11, 8, 8, 3
# float32 parity: microbatch sums reorder reductions (~1e-6 relative)
RTOL, ATOL = 1e-4, 1e-5


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class WithMask(nn.Module):
    """Returns a tuple whose second tensor (int64) needs no gradient."""

    def forward(self, x: torch.Tensor):
        return x, (x[..., 0] > -1e9).to(torch.int64)


class MaskedBlock(Block):
    def forward(self, xm):
        x, mask = xm
        return super().forward(x) * mask.unsqueeze(-1).to(x.dtype), mask


def head(emb: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.t()


def drop_mask(xm):
    return xm[0]


def tied_layers() -> list:
    """10 layers: tied embedding ... tied output head, a tuple with an int tensor in between."""
    return [
        TiedLayerSpec("emb", nn.Embedding, VOCAB, DIM),     # 0
        LayerSpec(Block, DIM),                               # 1
        LayerSpec(Block, DIM),                               # 2
        LayerSpec(WithMask),                                 # 3 -> (h, mask)
        LayerSpec(MaskedBlock, DIM),                         # 4 -> (h, mask)
        drop_mask,                                           # 5 callable
        LayerSpec(Block, DIM),                               # 6
        LayerSpec(Block, DIM),                               # 7
        LayerSpec(nn.LayerNorm, DIM),                        # 8
        TiedLayerSpec("emb", nn.Embedding, VOCAB, DIM, forward_fn=head),  # 9
    ]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def data(batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=g),
            torch.randint(0, VOCAB, (batch, SEQ), generator=g))


#: PipelineModule's default ``base_seed``: with ``seed_layers=True`` layer ``i`` is built right
#: after ``manual_seed(BASE_SEED + i)`` (a tied layer at its first position's index).
BASE_SEED = 1234


def _seeded(index: int, build):
    torch.manual_seed(BASE_SEED + index)
    return build()


class PlainTiedModel(nn.Module):
    """:func:`tied_layers` written as one plain torch model, independent of hyperpar: the same
    layers built with the same seeds, the output head tied to the embedding by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = _seeded(0, lambda: nn.Embedding(VOCAB, DIM))
        self.b1 = _seeded(1, lambda: Block(DIM))
        self.b2 = _seeded(2, lambda: Block(DIM))
        self.mask = WithMask()
        self.b4 = _seeded(4, lambda: MaskedBlock(DIM))
        self.b6 = _seeded(6, lambda: Block(DIM))
        self.b7 = _seeded(7, lambda: Block(DIM))
        self.norm = _seeded(8, lambda: nn.LayerNorm(DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.b4(self.mask(self.b2(self.b1(self.emb(tokens)))))
        h = self.norm(self.b7(self.b6(h)))
        return h @ self.emb.weight.t()

    #: this model's parameter names -> PipelineModule's (layer index, or the tied key)
    PIPELINE_NAMES = {"emb": "tied_modules.emb", "b1": "1", "b2": "2", "b4": "4", "b6": "6",
                      "b7": "7", "norm": "8"}

    def pipeline_named(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``values`` keyed by this model's parameter names, re-keyed as the pipeline's."""
        out = {}
        for name, value in values.items():
            head, rest = name.split(".", 1)
            out[f"{self.PIPELINE_NAMES[head]}.{rest}"] = value
        return out


def reference(batch: int = BATCH):
    """Loss and gradients (keyed by the pipeline's parameter names) of the plain torch model in
    one process on the full batch."""
    model = PlainTiedModel()
    x, y = data(batch)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.detach(), model.pipeline_named(
        {n: p.grad.clone() for n, p in model.named_parameters()})


def run_cases(cases: list[dict]) -> list[str]:
    """Run each case (schedule, n_microbatches, virtual_stages, partition, checkpoint, steps)
    on this rank's pipeline and compare with :func:`reference`; raise on the first mismatch."""
    ref_loss, ref_grads = reference()
    x, y = data()
    done = []
    for case in cases:
        what = ", ".join(f"{k}={v}" for k, v in case.items())
        module = PipelineModule(
            tied_layers(), loss_fn=lm_loss, seed_layers=True,
            partition_method=case.get("partition", "uniform"),
            virtual_stages=case.get("virtual_stages", 1),
            activation_checkpoint_interval=case.get("checkpoint", 0),
        )
        schedule = get_schedule_class(case["schedule"])(module, case["m"])
        for step in range(case.get("steps", 1)):
            module.zero_grad(set_to_none=True)
            losses: list = []
            loss = schedule.step(x, target=y, losses=losses)
            if module.total_stages - 1 in module.local_stages:
                assert len(losses) == case["m"], f"{what}: {len(losses)} microbatch losses"
                assert_close_to_reference(loss, ref_loss, rtol=RTOL, atol=ATOL,
                                          what=f"{what} step {step}: loss")
            else:
                assert loss is None
            grads = {n: p.grad for n, p in module.named_parameters()}
            assert grads, f"{what}: no local parameters"
            assert_close_to_reference(grads, {n: ref_grads[n] for n in grads}, rtol=RTOL,
                                      atol=ATOL, what=f"{what} step {step}: grad")
            for name, p in module.tied_parameters():
                assert p.grad is not None, f"{what}: tied {name} has no gradient"
        done.append(what)
    return done


def _train_and_compare(module, what: str, m: int = 3) -> None:
    ref_loss, ref_grads = reference()
    x, y = data()
    loss = get_schedule_class("1f1b")(module, m).step(x, target=y)
    if module.total_stages - 1 in module.local_stages:
        assert_close_to_reference(loss, ref_loss, rtol=RTOL, atol=ATOL, what=f"{what}: loss")
    grads = {n: p.grad for n, p in module.named_parameters()}
    assert_close_to_reference(grads, {n: ref_grads[n] for n in grads}, rtol=RTOL, atol=ATOL,
                              what=f"{what}: grad")


def run_group_cases() -> dict:
    """On 4 ranks: two 2-stage pipelines (num_stages=2), a ("dp", "pp") mesh, and tied-weight
    broadcast at build time without seeding."""
    from hyperpar.dtensor import init_device_mesh
    from hyperpar.platform import get_platform

    rank = get_platform().rank()
    out = {}
    module = PipelineModule(tied_layers(), num_stages=2, loss_fn=lm_loss, seed_layers=True)
    out["num_stages=2 stage_ranks"] = module.stage_ranks
    _train_and_compare(module, "num_stages=2 on 4 ranks")

    mesh = init_device_mesh(mesh_shape=(2, 2), mesh_dim_names=("dp", "pp"))
    module = PipelineModule(tied_layers(), mesh=mesh, loss_fn=lm_loss, seed_layers=True)
    out["mesh stage_ranks"] = module.stage_ranks
    _train_and_compare(module, "mesh ('dp', 'pp')")

    torch.manual_seed(100 + rank)          # every rank would build a different embedding
    module = PipelineModule(tied_layers(), loss_fn=lm_loss, seed_layers=False)
    out["tied"] = {n: p.detach().clone() for n, p in module.tied_parameters()}
    return out


def run_shape_cases() -> list[str]:
    """Merged outputs, a second step with another batch size (dynamic_shapes=True), and
    forward-only evaluation."""
    from hyperpar.pipeline import PipelineModule

    done = []
    module = PipelineModule(tied_layers(), loss_fn=lm_loss, seed_layers=True)
    sched = get_schedule_class("1f1b")(module, 3, dynamic_shapes=True)
    ref = PlainTiedModel()
    for batch in (BATCH, 5):
        x, y = data(batch)
        res = sched.step(x, target=y, return_outputs=True)
        if res is not None:
            loss, out = res
            with torch.no_grad():
                expected = ref(x)
            assert_close_to_reference(out, expected, rtol=RTOL, atol=ATOL, what="outputs")
            assert_close_to_reference(loss, lm_loss(expected, y), rtol=RTOL, atol=ATOL,
                                      what=f"loss at batch {batch}")
        done.append(f"batch {batch}")
    x, y = data()
    # 4 microbatches on 2 ranks x 2 virtual stages: the forward-only plan once refused this
    # as a deadlock (stage-major order)
    for name, n_mb in (("1f1b", 3), ("interleaved1f1b", 3), ("interleaved1f1b", 4)):
        module = PipelineModule(tied_layers(), loss_fn=lm_loss, seed_layers=True,
                                virtual_stages=2 if name.startswith("inter") else 1)
        res = get_schedule_class(name)(module, n_mb).eval_step(x, target=y,
                                                               return_outputs=True)
        assert all(p.grad is None for p in module.parameters()), "eval_step made gradients"
        if res is not None:
            loss, out = res
            with torch.no_grad():
                expected = ref(x)
            assert_close_to_reference(out, expected, rtol=RTOL, atol=ATOL, what="eval outputs")
            assert_close_to_reference(loss, lm_loss(expected, y), rtol=RTOL, atol=ATOL,
                                      what=f"{name} eval loss")
        done.append(f"eval {name} x{n_mb}")
    return done
