"""A checkpoint is untrusted input: ``load`` and ``load_safetensors`` read nothing outside the
checkpoint's folder, never open a FIFO, check the index's schema and its agreement with the
safetensors headers, refuse another optimizer's state, and a second job saving into the same
folder is refused. Every refusal is raised on every rank (none hangs). Each test here failed
on the code before these checks (loaded silently, hung, or raised a cryptic error)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch
from torch import nn

from hyperpar.checkpoint import load, load_safetensors, read_index, save
from hyperpar.platform import get_platform
from hyperpar.testing.harness import WorkerPool

#: Seconds a test run may take: far above a passing run, so an old-code hang fails the test.
LIMIT_S = 90


def _values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g), "r": torch.randn(5, generator=g)}


class _Model(nn.Module):
    """``w`` Shard(0) over all ranks (each rank writes a part), ``r`` Replicate."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("dp",))
        v = _values(seed)
        self.w = nn.Parameter(distribute_tensor(v["w"], mesh, [Shard(0)]))
        self.r = nn.Parameter(distribute_tensor(v["r"], mesh, [Replicate()]))


def _save(path: str, seed: int, file_format: str = "safetensors") -> None:
    save(_Model(seed), path, file_format=file_format)


def _error(fn, *args, **kwargs) -> str:
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # any type: the message is what a user reads
        return f"{type(exc).__name__}: {exc}"
    return f"no error: {result!r}"


def _load_error(path: str) -> str:
    return _error(load, _Model(seed=99), path)


def _edit_index(path, edit) -> None:
    file = os.path.join(path, "index.json")
    with open(file) as f:
        index = json.load(f)
    edit(index)
    with open(file, "w") as f:
        json.dump(index, f)


def _point_rank1_chunks_at(path, name: str, source_index: dict | None = None,
                           nbytes: int | None = None) -> None:
    """Make index.json name file ``name`` for the chunks rank 1 wrote. With ``source_index``
    (another checkpoint's), take its rank-1 digests and size too: a forged but consistent
    index, which the code before the checks loaded without a word."""

    def edit(index):
        (old,) = [f for f, meta in index["files"].items() if meta["rank"] == 1]
        meta = index["files"].pop(old)
        if source_index is not None:
            (src,) = [f for f, m in source_index["files"].items() if m["rank"] == 1]
            meta = dict(source_index["files"][src])
            digests = {(k, c["key"]): c["digest"]
                       for k, e in source_index["tensors"].items() for c in e["chunks"]}
            for key, entry in index["tensors"].items():
                for chunk in entry["chunks"]:
                    if chunk["file"] == old:
                        chunk["digest"] = digests[(key, chunk["key"])]
        if nbytes is not None:
            meta["bytes"] = nbytes
        index["files"][name] = meta
        for entry in index["tensors"].values():
            for chunk in entry["chunks"]:
                if chunk["file"] == old:
                    chunk["file"] = name

    _edit_index(path, edit)


def _rank1_file(path) -> str:
    (name,) = [f for f, m in read_index(path)["files"].items() if m["rank"] == 1]
    return os.path.join(path, name)


# ------------------------------------------------------------------ paths
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_chunk_file_outside_the_folder_is_refused_on_every_rank(run_on_ranks, tmp_path, how):
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    run_on_ranks(2, _save, str(ckpt), 0)
    run_on_ranks(2, _save, str(other), 5)  # the attacker's values, in a real shard file
    (tmp_path / "outside").mkdir()
    evil = tmp_path / "outside" / "evil.safetensors"
    shutil.copy(_rank1_file(other), evil)
    name = {"dotdot": "../outside/evil.safetensors", "absolute": str(evil),
            "symlink": "shard-00001-of-00002-link.safetensors"}[how]
    if how == "symlink":
        os.symlink(evil, ckpt / name)
    _point_rank1_chunks_at(ckpt, name, read_index(other))
    want = {"dotdot": "climbs out of the checkpoint folder", "absolute": "absolute path",
            "symlink": "outside the checkpoint folder"}[how]
    for rank, error in enumerate(run_on_ranks(2, _load_error, str(ckpt), timeout_s=LIMIT_S)):
        assert error.startswith("CheckpointError") and want in error and name in error, (
            rank, error)


def test_chunk_file_that_is_a_fifo_is_refused_not_opened(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    name = "shard-00001-of-00002-fifo.safetensors"
    os.mkfifo(tmp_path / name)  # opening it for reading would block until a writer comes
    _point_rank1_chunks_at(tmp_path, name, nbytes=0)  # a FIFO's size is 0
    for rank, error in enumerate(run_on_ranks(2, _load_error, str(tmp_path),
                                              timeout_s=LIMIT_S)):
        assert "not a regular file" in error and name in error, (rank, error)


# ------------------------------------------------------------------ Hugging Face index
HF_NAMES = {"w": (6, 4), "r": (5,)}


def _write_hf(folder, weight_map_value: str) -> None:
    """A Hugging Face folder whose index maps ``r`` to ``weight_map_value`` (``w`` to a file
    inside)."""
    from safetensors.torch import save_file

    v = _values(0)
    folder.mkdir(exist_ok=True)
    save_file({"w": v["w"]}, str(folder / "model-00001-of-00002.safetensors"))
    weight_map = {"w": "model-00001-of-00002.safetensors", "r": weight_map_value}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _load_hf_error(path: str) -> str:
    return _error(load_safetensors, _Model(seed=99), path)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "fifo"])
def test_hf_weight_map_outside_the_folder_or_not_a_file_is_refused(run_on_ranks, tmp_path,
                                                                   how):
    from safetensors.torch import save_file

    (tmp_path / "outside").mkdir()
    evil = tmp_path / "outside" / "evil.safetensors"
    save_file({"r": torch.full((5,), 666.0)}, str(evil))
    hf = tmp_path / "hf"
    name = {"dotdot": "../outside/evil.safetensors", "absolute": str(evil),
            "symlink": "model-00002-of-00002.safetensors",
            "fifo": "model-00002-of-00002.safetensors"}[how]
    _write_hf(hf, name)
    if how == "symlink":
        os.symlink(evil, hf / name)
    if how == "fifo":
        os.mkfifo(hf / name)
    want = {"dotdot": "climbs out", "absolute": "absolute path",
            "symlink": "outside the checkpoint folder", "fifo": "not a regular file"}[how]
    for rank, error in enumerate(run_on_ranks(2, _load_hf_error, str(hf), timeout_s=LIMIT_S)):
        assert error.startswith("CheckpointError") and want in error, (rank, error)


def test_hf_weight_map_inside_the_folder_still_loads(run_on_ranks, tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    _write_hf(hf, "sub/model-00002-of-00002.safetensors")  # a subfolder is inside
    (hf / "sub").mkdir()
    save_file({"r": _values(0)["r"]}, str(hf / "sub" / "model-00002-of-00002.safetensors"))
    for error in run_on_ranks(2, _load_hf_error, str(hf)):
        assert error.startswith("no error"), error


# ------------------------------------------------------------------ index vs header, schema
@pytest.mark.parametrize("file_format", ["safetensors", "torch"])
def test_dtype_edited_in_the_index_is_refused(run_on_ranks, tmp_path, file_format):
    run_on_ranks(2, _save, str(tmp_path), 0, file_format)

    def edit(index):
        index["tensors"]["w"]["dtype"] = "int64"

    _edit_index(tmp_path, edit)
    want = "index.json says 'int64'" if file_format == "safetensors" else "torch.int64"
    for rank, error in enumerate(run_on_ranks(2, _load_error, str(tmp_path))):
        assert error.startswith("CorruptCheckpointError") and want in error, (rank, error)
        assert "'w'" in error, (rank, error)


def _edit_huge_shape(index):
    index["tensors"]["w"]["shape"] = [10_000_000, 1_000_000]


_SCHEMA_EDITS = {
    "no tensors": lambda index: index.pop("tensors"),
    "tensors a list": lambda index: index.update(tensors=[]),
    "version a string": lambda index: index.update(version="2"),
    "offset a string": lambda index: index["tensors"]["w"]["chunks"][0].update(offset="0,0"),
    "chunk shape a number": lambda index: index["tensors"]["r"]["chunks"][0].update(shape=5),
    "chunk of an unlisted file": lambda index: index["tensors"]["r"]["chunks"][0].update(
        file="shard-00009-of-00009-x.safetensors"),
    "no files": lambda index: index.pop("files"),
    "huge shape": _edit_huge_shape,
}


@pytest.mark.parametrize("what", list(_SCHEMA_EDITS))
def test_malformed_index_is_named_on_every_rank(run_on_ranks, tmp_path, what):
    run_on_ranks(2, _save, str(tmp_path), 0)
    _edit_index(tmp_path, _SCHEMA_EDITS[what])
    for rank, error in enumerate(run_on_ranks(2, _load_error, str(tmp_path))):
        assert error.startswith("CheckpointError") and "index.json is malformed" in error, (
            rank, error)


def _huge_optimizer_state_error(path: str) -> str:
    """The optimizer state of a plain parameter is read at the index's shape."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    save(model, path, optimizer=opt)
    if get_platform().rank() == 0:
        _edit_index(path, lambda index: index["tensors"]["optimizer.weight.exp_avg"].update(
            shape=[10_000_000, 1_000_000]))
    get_platform().barrier()
    return _error(load, model, path, optimizer=opt)


def test_huge_shape_in_the_optimizer_state_is_refused_before_allocating(run_on_ranks,
                                                                        tmp_path):
    for rank, error in enumerate(run_on_ranks(2, _huge_optimizer_state_error, str(tmp_path))):
        assert error.startswith("CheckpointError") and "optimizer.weight.exp_avg" in error, (
            rank, error)
        assert "has 10000000000000" in error, (rank, error)


def _load_with_rank1_path(good: str, bad: str) -> str:
    return _load_error(good if get_platform().rank() == 0 else bad)


def test_a_problem_only_one_rank_sees_is_raised_on_every_rank(run_on_ranks, tmp_path):
    """Rank 1 is given a folder whose index is malformed: rank 0 must not wait for it."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    run_on_ranks(2, _save, str(good), 0)
    run_on_ranks(2, _save, str(bad), 0)
    _edit_index(bad, _SCHEMA_EDITS["no tensors"])
    t0 = time.monotonic()
    errors = run_on_ranks(2, _load_with_rank1_path, str(good), str(bad), timeout_s=LIMIT_S)
    print(f"one rank's refusal reached every rank in {time.monotonic() - t0:.1f} s")
    assert "index.json is malformed" in errors[1], errors[1]
    assert errors[0].startswith("CheckpointError: rank 1: ") and "malformed" in errors[0], (
        errors[0])


def _load_with_rank1_failing_to_copy(path: str) -> str:
    """Rank 1 fails while copying a tensor in (an error that is not a checkpoint error)."""
    import hyperpar.checkpoint.loader as loader

    real = loader.copy_box

    def broken(value, box):
        raise RuntimeError("simulated failure while copying on rank 1")

    if get_platform().rank() == 1:
        loader.copy_box = broken
    try:
        return _load_error(path)
    finally:
        loader.copy_box = real  # the worker process serves later tests


def test_any_failure_while_reading_on_one_rank_is_raised_on_every_rank(run_on_ranks,
                                                                       tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    errors = run_on_ranks(2, _load_with_rank1_failing_to_copy, str(tmp_path),
                          timeout_s=LIMIT_S)
    assert errors[1].startswith("RuntimeError: simulated failure"), errors[1]
    assert errors[0].startswith("CheckpointError: rank 1: RuntimeError: simulated failure"), (
        errors[0])


# ------------------------------------------------------------------ optimizer state
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _save_adamw_load_into(path: str, kind: str) -> str:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    save(model, path, optimizer=opt)
    if kind == "sgd":
        target = torch.optim.SGD(model.parameters(), lr=0.01)
    elif kind == "two groups":
        params = list(model.parameters())
        target = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=0.01)
    elif kind == "amsgrad":  # same class, already stepped with another state layout
        target = torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
        _step(model, target)
    else:
        target = torch.optim.AdamW(model.parameters(), lr=0.5)
    return _error(load, model, path, optimizer=target)


@pytest.mark.parametrize(("kind", "want"), [
    ("sgd", "holds the state of a torch.optim.adamw.AdamW but the optimizer given is a "
            "torch.optim.sgd.SGD"),
    ("two groups", "holds 1 parameter group(s) but the optimizer has 2"),
    ("amsgrad", "'max_exp_avg_sq'"),
])
def test_optimizer_state_of_another_type_or_layout_is_refused(run_on_ranks, tmp_path, kind,
                                                             want):
    for rank, error in enumerate(run_on_ranks(2, _save_adamw_load_into, str(tmp_path), kind)):
        assert error.startswith("CheckpointError") and want in error, (rank, error)
    # the same optimizer as saved still loads
    for error in run_on_ranks(2, _save_adamw_load_into, str(tmp_path), "adamw"):
        assert error.startswith("no error"), error


# ------------------------------------------------------------------ concurrent saves
def _save_holding_the_lock_until(path: str, release_file: str, seed: int) -> str:
    """Save, but on rank 0 wait (lock held, own shard not yet written) until ``release_file``
    exists."""
    import safetensors.torch as st

    real = st.save_file

    def wait_then_save(*args, **kwargs):
        deadline = time.monotonic() + LIMIT_S
        while not os.path.exists(release_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        return real(*args, **kwargs)

    if get_platform().rank() == 0:
        st.save_file = wait_then_save
    try:
        return _error(_save, path, seed)
    finally:
        st.save_file = real  # the worker process serves later tests


def _rank() -> int:
    return get_platform().rank()


def _second_job_save(path: str) -> str:
    return _error(_save, path, 7)


def test_second_job_saving_into_the_same_folder_is_refused(run_on_ranks, tmp_path):
    ckpt, go = tmp_path / "ckpt", tmp_path / "go"
    run_on_ranks(2, _save, str(ckpt), 0)  # an existing checkpoint to protect
    first: list = []
    # The second job: its own 2 processes, started before the first job takes the lock so the
    # first job's rank 1 does not wait long in its collective.
    with WorkerPool(2, backend=os.environ.get("HYPERPAR_BACKEND") or None,
                    collective_timeout_s=LIMIT_S) as other_job:
        other_job.run(_rank)  # started and connected
        job = threading.Thread(target=lambda: first.extend(run_on_ranks(
            2, _save_holding_the_lock_until, str(ckpt), str(go), 1, timeout_s=LIMIT_S)))
        job.start()
        try:
            deadline = time.monotonic() + LIMIT_S
            while not (ckpt / ".hyperpar-save.lock").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            second = other_job.run(_second_job_save, str(ckpt), timeout_s=LIMIT_S)
        finally:
            go.touch()
            job.join()
    for rank, error in enumerate(second):
        assert error.startswith("ConcurrentSaveError") and "another job is saving" in error, (
            rank, error)
        assert "pid " in error and socket.gethostname() in error, (rank, error)
    assert first == ["no error: None"] * 2, first
    index = read_index(ckpt)
    assert sorted(os.listdir(ckpt)) == sorted(["index.json", *index["files"]])  # no leftovers
    for state in run_on_ranks(2, _load_full, str(ckpt)):
        torch.testing.assert_close(state, _values(1), rtol=0, atol=0)  # the first job's save


def _load_full(path: str) -> dict[str, torch.Tensor]:
    model = _Model(seed=99)
    load(model, path)
    return {"w": model.w.full_tensor().detach(), "r": model.r.full_tensor().detach()}


def _save_error(path: str, seed: int, force: bool = False) -> str:
    kwargs = {"force": True} if force else {}
    return _error(save, _Model(seed), path, file_format="safetensors", **kwargs)


def test_lock_left_by_a_dead_process_on_this_host_is_taken_over(run_on_ranks, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process
    (tmp_path / ".hyperpar-save.lock").write_text(json.dumps(
        {"pid": dead.pid, "host": socket.gethostname(), "save_id": "0", "started": "then"}))
    for error in run_on_ranks(2, _save_error, str(tmp_path), 3):
        assert error.startswith("no error"), error
    assert not (tmp_path / ".hyperpar-save.lock").exists()
    for state in run_on_ranks(2, _load_full, str(tmp_path)):
        torch.testing.assert_close(state, _values(3), rtol=0, atol=0)


def test_lock_held_on_another_host_is_refused_unless_forced(run_on_ranks, tmp_path):
    lock = tmp_path / ".hyperpar-save.lock"
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere.example", "save_id": "abc",
                                "started": "2026-01-01T00:00:00Z"}))
    for rank, error in enumerate(run_on_ranks(2, _save_error, str(tmp_path), 3)):
        assert error.startswith("ConcurrentSaveError") and "'elsewhere.example'" in error, (
            rank, error)
        assert "force=True" in error, (rank, error)
    assert sorted(os.listdir(tmp_path)) == [".hyperpar-save.lock"]  # nothing written
    for error in run_on_ranks(2, _save_error, str(tmp_path), 3, True):
        assert error.startswith("no error"), error
    assert not lock.exists()
