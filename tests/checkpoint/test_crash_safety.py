"""A checkpoint is never lost or silently wrong: a rank dying mid-save leaves the previous
checkpoint loadable, changed or truncated files are named on load, ``strict`` rejects keys the
model lacks. Each test here failed on the format that overwrote shard files in place."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from hyperpar.checkpoint import load, read_index, save
from hyperpar.platform import get_platform
from hyperpar.testing import DistributedError


def _values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g), "r": torch.randn(5, generator=g),
            "buf": torch.randn(3, generator=g)}


class _Model(nn.Module):
    """``w`` Shard(0) over all ranks (each rank writes a part), ``r`` Replicate (rank 0 writes
    it), ``buf`` an optional plain buffer."""

    def __init__(self, seed: int, with_buf: bool = True) -> None:
        super().__init__()
        from hyperpar.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh((get_platform().world_size(),), mesh_dim_names=("dp",))
        v = _values(seed)
        self.w = nn.Parameter(distribute_tensor(v["w"], mesh, [Shard(0)]))
        self.r = nn.Parameter(distribute_tensor(v["r"], mesh, [Replicate()]))
        if with_buf:
            self.register_buffer("buf", v["buf"])


def _save(path: str, seed: int) -> None:
    save(_Model(seed), path, file_format="safetensors")


def _load_full(path: str, with_buf: bool = True, strict: bool = True) -> dict[str, torch.Tensor]:
    model = _Model(seed=99, with_buf=with_buf)  # other values: load must overwrite them all
    load(model, path, strict=strict)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _load_error(path: str, with_buf: bool = True) -> str:
    try:
        _load_full(path, with_buf)
    except Exception as exc:  # any type: the message is what a user reads
        return f"{type(exc).__name__}: {exc}"
    return "loaded without error"


def _save_and_die_mid_write(path: str, seed: int, notes: str) -> None:
    """Rank 1 dies (``os._exit``) halfway through writing its shard, after rank 0 has finished
    writing its own new shard; the process gets no chance to clean up. At the moment it dies,
    rank 1 records what is on disk in ``notes/crash.json`` (the test checks the crash hit the
    moment it claims); rank 0 marks the end of its shard write in ``notes/rank0-wrote``."""
    import json

    import safetensors.torch as st

    real = st.save_file
    rank = get_platform().rank()
    rank0_done = os.path.join(notes, "rank0-wrote")
    if rank == 0:
        def write_then_mark(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            # write the mark under another name, then rename: rank 1 polls for the name, and
            # must never see it created but still empty (that race failed this test once)
            with open(rank0_done + ".tmp", "w") as f:
                f.write(os.path.basename(filename))
            os.replace(rank0_done + ".tmp", rank0_done)

        st.save_file = write_then_mark
    else:
        old = read_index(path)

        def half_then_die(tensors, filename, metadata=None):
            deadline = time.monotonic() + 120  # a bound on waiting, not a timing assertion
            while not os.path.exists(rank0_done) and time.monotonic() < deadline:
                time.sleep(0.05)
            data = st.save(tensors, metadata=metadata)
            with open(filename, "wb") as f:
                f.write(data[: len(data) // 2])
            rank0_file = open(rank0_done).read() if os.path.exists(rank0_done) else None
            state = {
                "rank0_file": rank0_file,
                "rank0_file_on_disk": bool(rank0_file)
                and os.path.exists(os.path.join(path, rank0_file)),
                "old_files": old["files"], "index_save_id_at_crash": read_index(path)["save_id"],
                "old_save_id": old["save_id"], "my_file": os.path.basename(filename),
                "my_bytes_on_disk": os.path.getsize(filename), "my_full_bytes": len(data),
            }
            with open(os.path.join(notes, "crash.json"), "w") as f:
                json.dump(state, f)
            os._exit(17)

        st.save_file = half_then_die
    try:
        save(_Model(seed), path, file_format="safetensors")
    finally:
        st.save_file = real  # rank 0's worker serves later tests


def test_rank_dying_mid_save_leaves_the_previous_checkpoint_intact(run_on_ranks, tmp_path):
    import json

    ckpt = tmp_path / "ckpt"
    run_on_ranks(2, _save, str(ckpt), 0)
    # Which rank the harness names first (the dead one, or rank 0 whose collective lost its
    # peer) is the harness's business; here the save must fail and leave the old checkpoint.
    with pytest.raises(DistributedError):
        run_on_ranks(2, _save_and_die_mid_write, str(ckpt), 1, str(tmp_path))
    # The crash hit where it claims: rank 0's new shard complete on disk, rank 1's new shard half
    # written, the index still the old save's.
    crash = json.loads((tmp_path / "crash.json").read_text())
    assert crash["rank0_file"] and crash["rank0_file"] not in crash["old_files"], crash
    assert crash["rank0_file_on_disk"], crash
    assert crash["my_file"] not in crash["old_files"], crash
    assert 0 < crash["my_bytes_on_disk"] == crash["my_full_bytes"] // 2, crash
    assert crash["index_save_id_at_crash"] == crash["old_save_id"], crash
    assert read_index(ckpt)["save_id"] == crash["old_save_id"]
    for state in run_on_ranks(2, _load_full, str(ckpt)):
        torch.testing.assert_close(state, _values(0), rtol=0, atol=0)  # all old, no mix


def _save_with_rank1_disk_full(path: str, seed: int) -> str:
    import safetensors.torch as st

    def disk_full(tensors, filename, metadata=None):
        raise OSError(28, "No space left on device", filename)

    real = st.save_file
    if get_platform().rank() == 1:
        st.save_file = disk_full
    try:
        save(_Model(seed), path, file_format="safetensors")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        st.save_file = real  # the worker process serves later tests
    return "saved"


def test_a_rank_failing_to_write_fails_the_save_on_every_rank(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    for error in run_on_ranks(2, _save_with_rank1_disk_full, str(tmp_path), 1):
        assert "rank 1 could not write" in error and "No space left" in error, error
    for state in run_on_ranks(2, _load_full, str(tmp_path)):
        torch.testing.assert_close(state, _values(0), rtol=0, atol=0)


def test_next_save_removes_files_a_crashed_save_left(run_on_ranks, tmp_path):
    (tmp_path / "shard-00001-of-00002-0123abc.safetensors").write_bytes(b"half a file")
    (tmp_path / "notes.txt").write_text("not ours")
    run_on_ranks(2, _save, str(tmp_path), 0)
    files = {c["file"] for e in read_index(tmp_path)["tensors"].values() for c in e["chunks"]}
    assert sorted(os.listdir(tmp_path)) == sorted({"index.json", "notes.txt", *files})


def _shard_of_rank(path, rank: int) -> str:
    files = {c["file"] for e in read_index(path)["tensors"].values() for c in e["chunks"]
             if c["rank"] == rank}
    (name,) = files
    return os.path.join(path, name)


def test_changed_tensor_bytes_are_named_on_every_rank(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    shard = _shard_of_rank(tmp_path, 1)
    with open(shard, "r+b") as f:  # same size, last 4 bytes (tensor data) changed
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x00\xc0\x7f")
    errors = run_on_ranks(2, _load_error, str(tmp_path))
    for rank, error in enumerate(errors):
        assert os.path.basename(shard) in error and "digest" in error, (rank, error)


def test_truncated_shard_is_named_on_every_rank(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    shard = _shard_of_rank(tmp_path, 1)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    errors = run_on_ranks(2, _load_error, str(tmp_path))
    for rank, error in enumerate(errors):
        assert os.path.basename(shard) in error and "truncated" in error, (rank, error)


def test_strict_load_rejects_checkpoint_keys_the_model_lacks(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    errors = run_on_ranks(2, _load_error, str(tmp_path), False)
    for error in errors:
        assert "not in the model" in error and "'buf'" in error, error


def _load_lenient(path: str) -> tuple[list[str], list[str], dict[str, torch.Tensor]]:
    model = _Model(seed=99, with_buf=False)
    missing, unexpected = load(model, path, strict=False)
    return missing, unexpected, {"w": model.w.full_tensor(), "r": model.r.full_tensor()}


def test_non_strict_load_reports_unexpected_keys_like_torch(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    for missing, unexpected, state in run_on_ranks(2, _load_lenient, str(tmp_path)):
        assert (missing, unexpected) == ([], ["buf"])
        torch.testing.assert_close(state["w"], _values(0)["w"], rtol=0, atol=0)


def test_format_version_1_checkpoints_still_load(run_on_ranks, tmp_path):
    """Folders written before per-save names and digests (files overwritten in place)."""
    import json

    run_on_ranks(2, _save, str(tmp_path), 0)
    index = read_index(tmp_path)
    for old, new in ((f, f.replace(f"-{index['save_id']}", "")) for f in index["files"]):
        os.rename(tmp_path / old, tmp_path / new)
    for entry in index["tensors"].values():
        for chunk in entry["chunks"]:
            chunk["file"] = chunk["file"].replace(f"-{index['save_id']}", "")
            del chunk["digest"]
    for key in ("files", "save_id", "digest"):
        del index[key]
    index["version"] = 1
    (tmp_path / "index.json").write_text(json.dumps(index))
    for state in run_on_ranks(2, _load_full, str(tmp_path)):
        torch.testing.assert_close(state, _values(0), rtol=0, atol=0)
