"""The analytical model against the real code at scale: the simulation backend (hyperpar-sim)
runs the real parallelize_module + fully_shard for a 1024-rank mesh in this one process, on
meta tensors, as rank 0 and as the last rank. Per-rank parameter/gradient/optimizer elements and
the per-step collective bytes per mesh dim must equal the planner's."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
hyperpar_sim = pytest.importorskip("hyperpar_sim", reason="install backends/hyperpar-sim")

from hyperpar.plan.layout import Layout, Run  # noqa: E402
from hyperpar.plan.memory import memory_per_rank  # noqa: E402
from hyperpar.plan.model import spec_from_model_args  # noqa: E402
from hyperpar.plan.timing import collectives  # noqa: E402

from ._common import ROOT  # noqa: E402, F401  (puts the repository on sys.path)

# Llama-2-7B's widths (uneven fully_shard rows at 128-way: 11008/8/128, 32000/8/128), 4 layers
SIZES = {"vocab_size": 32000, "dim": 4096, "n_layers": 4, "n_heads": 32, "ffn_hidden": 11008}
SEQ = 32


def _grads_and_adamw_states(params: list) -> tuple[int, int]:
    """Local gradient elements after backward, and local AdamW state elements after a step."""
    grads = sum(p.grad.to_local().numel() for p in params if p.grad is not None)
    opt = torch.optim.AdamW(params)
    opt.step()
    states = sum(v.to_local().numel() for p in params for k, v in opt.state[p].items()
                 if k != "step")
    return grads, states


def _simulate(layout: Layout, rank: int) -> dict:
    from examples.llama import model as llama
    from examples.llama import plan as plans
    from hyperpar import fully_shard, init_device_mesh, parallelize_module

    with hyperpar_sim.simulate(world=layout.world, rank=rank) as sim:
        mesh = init_device_mesh((layout.dp_shard, layout.tp), mesh_dim_names=("dp_shard", "tp"))
        with torch.device("meta"):
            model = llama.Transformer(llama.ModelArgs(**SIZES, max_seq_len=SEQ))
        if layout.tp > 1:
            parallelize_module(model, mesh["tp"], plans.tp_sp_plan())
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
        params = list(model.parameters())
        local = sum(p.to_local().numel() for p in params)
        sim.records.clear()
        tokens = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
        model(tokens).float().sum().backward()
        volume = sim.volume_by_dim(mesh)
        ops = Counter((r.op, r.nbytes) for r in sim.records)
        grads, states = _grads_and_adamw_states(params)
    return {"local": local, "grads": grads, "states": states, "volume": volume, "ops": ops}


@pytest.fixture(scope="module")
def fsdp_tp_rank0() -> dict:
    return _simulate(Layout(dp_shard=128, tp=8), rank=0)


def _planned(layout: Layout):
    spec = spec_from_model_args(SIZES)
    run = Run(world=layout.world, seq_len=SEQ, global_batch=layout.dp, param_dtype="float32")
    return spec, run, memory_per_rank(spec, run, layout)


def test_sim_per_rank_states_equal_the_model_at_1024_ranks(fsdp_tp_rank0) -> None:
    _, _, mem = _planned(Layout(dp_shard=128, tp=8))
    assert 4 * fsdp_tp_rank0["local"] == mem.params
    assert 4 * fsdp_tp_rank0["grads"] == mem.grads
    assert 4 * fsdp_tp_rank0["states"] == mem.optimizer


def test_sim_collective_bytes_per_mesh_dim_equal_the_model(fsdp_tp_rank0) -> None:
    layout = Layout(dp_shard=128, tp=8)
    spec, run, _ = _planned(layout)
    planned: dict[str, float] = {}
    for c in collectives(spec, run, layout, stage=0):
        planned[c.dim] = planned.get(c.dim, 0) + c.nbytes * c.per_step(layout.microbatches)
    assert fsdp_tp_rank0["volume"] == {k: int(v) for k, v in planned.items()}, \
        fsdp_tp_rank0["ops"]


def test_sim_last_rank_holds_no_more_than_rank_0() -> None:
    # uneven fully_shard: the last ranks hold fewer rows (or none); the planner reports the max
    last = _simulate(Layout(dp_shard=128, tp=8), rank=1023)
    _, _, mem = _planned(Layout(dp_shard=128, tp=8))
    assert 0 < 4 * last["local"] < mem.params


def test_sim_pure_fully_shard_over_1024_ranks() -> None:
    layout = Layout(dp_shard=1024)
    got = _simulate(layout, rank=0)
    spec, _, mem = _planned(layout)
    assert 4 * got["local"] == mem.params
    assert 16 * got["local"] == mem.states  # fp32 AdamW: 16 bytes per local element
    assert mem.states > 16 * spec.parameters / 1024  # padding of the uneven shards on rank 0


def test_sim_collectives_keep_shapes_and_record_bytes() -> None:
    with hyperpar_sim.simulate(world=8, rank=5) as sim:
        group = sim.new_group([4, 5, 6, 7])
        assert (sim.rank(group), sim.world_size(group), sim.rank()) == (1, 4, 5)
        x = torch.arange(6.0).reshape(3, 2)
        out = torch.empty(12, 2)
        sim.all_gather_into_tensor(out, x, group=group)
        assert torch.equal(out, x.repeat(4, 1))
        rs = torch.empty(3, 2)
        sim.reduce_scatter_tensor(rs, out, group=group)
        assert torch.equal(rs, out[3:6])  # this rank's rows (group rank 1)
        with pytest.raises(ValueError, match="not 4 x input"):
            sim.all_gather_into_tensor(torch.empty(5, 2), x, group=group)
        assert [(r.op, r.nbytes, r.group) for r in sim.records] == [
            ("all_gather", 96, (4, 5, 6, 7)), ("reduce_scatter", 96, (4, 5, 6, 7))]
        assert sim.rank(sim.new_group([0, 1])) == -1


def test_sim_rank_outside_the_world_is_an_error() -> None:
    with pytest.raises(ValueError, match="rank 8 of world 8 is impossible"):
        with hyperpar_sim.simulate(world=8, rank=8):
            pass


# -- pipelines: the real PipelineModule + Schedule1F1B for one stage of a 1024-rank pp x fsdp mesh

PP, DS, MB = 4, 256, 4


def _simulate_pipeline(rank: int) -> dict:
    from examples.llama import model as llama
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.pipeline import get_schedule_class
    from hyperpar.pipeline.p2p import Meta, TensorMeta
    from hyperpar.plan._runs import Block, pipeline, shard_pipeline_ends

    with hyperpar_sim.simulate(world=PP * DS, rank=rank) as sim:
        mesh = init_device_mesh((PP, DS), mesh_dim_names=("pp", "dp_shard"))
        args = llama.ModelArgs(**SIZES, max_seq_len=SEQ)
        pipe = pipeline(args, mesh, PP, device="meta")
        shard_pipeline_ends(pipe, mesh["dp_shard"])
        for block in [m for m in pipe.modules() if isinstance(m, Block)]:
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(pipe, mesh=mesh["dp_shard"])
        local = sum(p.to_local().numel() for p in pipe.parameters())
        schedule = get_schedule_class("1f1b")(pipe, n_microbatches=MB)
        # meta tensors hold no values, so the shape header a previous stage sends cannot be
        # read: give the receiving side the shapes it would decode (one microbatch of hidden
        # states), as the cache holds them after a real first step
        act = Meta(True, (TensorMeta((1, SEQ, SIZES["dim"]), torch.float32, True),))
        for step in schedule.program:
            for c in step.comms:
                if c.kind == "recv" and c.what == "act":
                    schedule._train_p2p._recv_meta[(c.what, c.stage, c.mb)] = act
        tokens = torch.zeros(MB, SEQ, dtype=torch.long, device="meta")
        schedule.step(tokens, target=tokens)   # first step: shape headers travel once
        sim.records.clear()
        schedule.step(tokens, target=tokens)
        return {"local": local, "stage": pipe.stage_id,
                "collectives": sim.volume_by_dim(mesh, ops=("all_gather", "reduce_scatter",
                                                            "all_reduce")),
                "sent": sim.volume_by_dim(mesh, ops=("send",))}


@pytest.mark.parametrize("rank", [0, 256, 1023], ids=["stage0", "stage1", "stage3"])
def test_sim_pipeline_stage_bytes_and_volumes_equal_the_model(rank: int) -> None:
    got = _simulate_pipeline(rank)
    layout = Layout(pp=PP, dp_shard=DS, microbatches=MB)
    spec = spec_from_model_args(SIZES)
    run = Run(world=PP * DS, seq_len=SEQ, global_batch=DS * MB, param_dtype="float32")
    assert got["stage"] == rank // DS
    from hyperpar.plan.memory import stage_memory

    mem = stage_memory(spec, run, layout, got["stage"])
    if rank % DS == 0:   # rank 0 of its dp group: the ceil(rows / n) shard the model reports
        assert 4 * got["local"] == mem.params
    else:
        assert 0 < 4 * got["local"] <= mem.params
    planned: dict[str, float] = {}
    for c in collectives(spec, run, layout, stage=got["stage"]):
        planned[c.dim] = planned.get(c.dim, 0) + c.nbytes * c.per_step(layout.microbatches)
    assert got["collectives"] == {"dp_shard": int(planned["dp_shard"])}
    assert got["sent"] == {"pp": int(planned["pp"])}


def _cp_forward_backward(sim, mesh, model, layout: Layout) -> None:
    """One forward + backward of ``model`` on a sequence split over ``mesh["cp"]``, with the
    simulator's records cleared first (only the step's collectives are counted)."""
    from hyperpar.parallel import context_parallel

    tokens = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    sim.records.clear()
    with context_parallel(mesh["cp"], buffers=[tokens, model.rope_cos, model.rope_sin],
                          buffer_seq_dims=[1, 0, 0]):
        assert tokens.shape == (1, SEQ // layout.cp)
        model(tokens).float().sum().backward()


def _simulate_cp(layout: Layout, rank: int) -> dict[str, int]:
    """The real context_parallel on the example Llama at 1024 ranks (dp_replicate x cp): the
    bytes its attention all-gathers and reduce-scatters per mesh dim in one forward + backward."""
    from examples.llama import model as llama
    from hyperpar import init_device_mesh

    with hyperpar_sim.simulate(world=layout.world, rank=rank) as sim:
        mesh = init_device_mesh((layout.dp_replicate, layout.cp),
                                mesh_dim_names=("dp_replicate", "cp"))
        with torch.device("meta"):
            model = llama.Transformer(llama.ModelArgs(**SIZES, max_seq_len=SEQ))
        _cp_forward_backward(sim, mesh, model, layout)
        return sim.volume_by_dim(mesh, ops=["all_gather", "reduce_scatter"])


@pytest.mark.parametrize("rank", [0, 1023])
def test_sim_context_parallel_attention_bytes_equal_the_model(rank: int) -> None:
    layout = Layout(dp_replicate=256, cp=4)
    spec, run, _ = _planned(layout)
    from hyperpar.plan.timing import cp_collectives

    planned = sum(c.nbytes * c.per_step(layout.microbatches)
                  for c in cp_collectives(spec, run, layout, stage=0) if c.kind in ("ag", "rs"))
    assert planned > 0
    assert _simulate_cp(layout, rank) == {"cp": int(planned)}


# -- fully_shard over the flattened dp_shard x cp group with context_parallel over cp


def _simulate_fsdp_cp(layout: Layout, rank: int) -> dict:
    """The real fully_shard (over ``_runs.fsdp_mesh``: the flattened dp_shard x cp group, 2-D
    with dp_replicate for HSDP) and context_parallel over cp, as ``--measure`` lays them out,
    for one forward + backward and an AdamW step at 1024 ranks."""
    from examples.llama import model as llama
    from hyperpar import fully_shard, init_device_mesh
    from hyperpar.plan._runs import MESH_DIMS, fsdp_mesh

    with hyperpar_sim.simulate(world=layout.world, rank=rank) as sim:
        mesh = init_device_mesh(tuple(layout.size(d) for d in MESH_DIMS),
                                mesh_dim_names=MESH_DIMS)
        dp_mesh = fsdp_mesh(mesh, layout)
        with torch.device("meta"):
            model = llama.Transformer(llama.ModelArgs(**SIZES, max_seq_len=SEQ))
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        params = list(model.parameters())
        local = sum(p.to_local().numel() for p in params)
        _cp_forward_backward(sim, mesh, model, layout)
        shard_dim = dp_mesh.mesh_dim_names[-1]
        volume = {("dp_shard" if k == shard_dim else k): v
                  for k, v in sim.volume_by_dim(dp_mesh).items() if k in dp_mesh.mesh_dim_names}
        volume.update({k: v for k, v in sim.volume_by_dim(mesh).items() if k == "cp"})
        total = sum(r.nbytes for r in sim.records)
        grads, states = _grads_and_adamw_states(params)
    return {"local": local, "grads": grads, "states": states, "volume": volume, "total": total}


@pytest.mark.parametrize("layout", [Layout(dp_shard=256, cp=4),
                                    Layout(dp_replicate=4, dp_shard=64, cp=4)],
                         ids=lambda x: x.name)
@pytest.mark.parametrize("rank", [0, 1023])
def test_sim_fully_shard_over_dp_shard_x_cp_equals_the_model(layout: Layout, rank: int) -> None:
    got = _simulate_fsdp_cp(layout, rank)
    spec, run, mem = _planned(layout)
    n = layout.dp_shard * layout.cp
    # the parameters, gradients and AdamW states are sharded dp_shard * cp ways
    if rank == 0:
        assert (4 * got["local"], 4 * got["grads"], 4 * got["states"]) == \
            (mem.params, mem.grads, mem.optimizer)
    else:  # uneven rows: the last rank of the group holds fewer
        assert 0 < 4 * got["local"] <= mem.params
    assert mem.params < 4 * spec.parameters // n + 4 * spec.parameters // n // 10
    planned: dict[str, float] = {}
    for c in collectives(spec, run, layout, stage=0):
        planned[c.dim] = planned.get(c.dim, 0) + c.nbytes * c.per_step(layout.microbatches)
    # fully_shard's bytes on the flattened group (booked on dp_shard), cp's K/V on cp, the
    # replicas' all-reduces of the gradient shards (HSDP); nothing on any other group
    assert got["volume"] == {k: int(v) for k, v in planned.items()}
    assert got["total"] == sum(got["volume"].values())
    assert "cp" in got["volume"] and "dp_shard" in got["volume"]
