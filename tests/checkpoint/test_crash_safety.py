"""A checkpoint is never lost or silently wrong: a rank dying mid-save leaves the previous
checkpoint loadable, changed or truncated files are named on load, ``strict`` rejects keys the
model lacks. Each test here failed on the format that overwrote shard files in place."""

from __future__ import annotations

import glob
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


def _save_and_die_mid_write(path: str, seed: int) -> None:
    """Rank 1 dies (``os._exit``) halfway through writing its shard, after rank 0 has written
    its own new shard; the process gets no chance to clean up."""
    import safetensors.torch as st

    if get_platform().rank() == 1:
        started = time.time()

        def half_then_die(tensors, filename, metadata=None):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # rank 0's new shard is on disk
                if any(os.path.getmtime(f) >= started
                       for f in glob.glob(os.path.join(path, "shard-00000-*"))):
                    break
                time.sleep(0.05)
            data = st.save(tensors, metadata=metadata)
            with open(filename, "wb") as f:
                f.write(data[: len(data) // 2])
            os._exit(17)

        st.save_file = half_then_die
    save(_Model(seed), path, file_format="safetensors")


def test_rank_dying_mid_save_leaves_the_previous_checkpoint_intact(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    t0 = time.monotonic()
    # Which rank the harness names first (the dead one, or rank 0 whose collective lost its
    # peer) is the harness's business; here the save must fail and leave the old checkpoint.
    with pytest.raises(DistributedError):
        run_on_ranks(2, _save_and_die_mid_write, str(tmp_path), 1)
    time_to_fail = time.monotonic() - t0
    for state in run_on_ranks(2, _load_full, str(tmp_path)):
        torch.testing.assert_close(state, _values(0), rtol=0, atol=0)  # all old, no mix
    print(f"crash mid-save: the save failed after {time_to_fail:.1f} s")


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
