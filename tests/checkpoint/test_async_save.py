"""``async_save``: the call returns once the tensors are staged in host memory, the write and
the commit happen in a background thread, and the guarantees of ``save`` still hold (atomic
commit, digests, a crash mid-write keeps the previous checkpoint, one save at a time). Each
test runs 2 real processes; values compare exactly (a checkpoint copies bytes)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from hyperpar.checkpoint import async_save, load, read_index, save
from hyperpar.platform import get_platform
from hyperpar.testing import DistributedError

from .test_crash_safety import _load_full, _Model, _save, _values


def _held_write(path: str, seed: int) -> dict:
    """Every rank's background write waits until the calling thread has overwritten every
    parameter (after ``async_save`` returned): the file must still hold the values of the
    call. Also records that nothing was committed before the write was let go."""
    import safetensors.torch as st

    real, go = st.save_file, threading.Event()

    def held(tensors, filename, metadata=None):
        go.wait(120)  # a bound on waiting for the main thread, not a timing assertion
        real(tensors, filename, metadata=metadata)

    st.save_file = held
    try:
        model = _Model(seed)
        before = read_index(path)["save_id"]
        future = async_save(model, path, file_format="safetensors")
        returned_before_write = not future.done()
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(-1.0)  # what a training step would do to the weights
        index_while_held = read_index(path)["save_id"]
        go.set()
        result = future.result(timeout=120)
    finally:
        st.save_file = real
    return {"returned_before_write": returned_before_write, "result": result,
            "uncommitted": index_while_held == before,
            "committed": read_index(path)["save_id"] != before}


def test_async_save_writes_the_values_of_the_call_not_later_ones(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    for out in run_on_ranks(2, _held_write, str(tmp_path), 1):
        assert out["returned_before_write"] and out["uncommitted"], out
        assert out["committed"] and out["result"] == str(tmp_path / "index.json"), out
    for state in run_on_ranks(2, _load_full, str(tmp_path)):
        torch.testing.assert_close(state, _values(1), rtol=0, atol=0)


def _async_save_and_die_mid_write(path: str, seed: int, notes: str) -> None:
    """Rank 1's background writer dies (``os._exit``, no clean-up) with half its shard on
    disk, after rank 0's background writer finished its own shard; it records what was on
    disk at that moment in ``notes/crash.json``."""
    import safetensors.torch as st

    real = st.save_file
    rank = get_platform().rank()
    rank0_done = os.path.join(notes, "rank0-wrote")
    if rank == 0:
        def write_then_mark(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            with open(rank0_done + ".tmp", "w") as f:
                f.write(os.path.basename(filename))
            os.replace(rank0_done + ".tmp", rank0_done)

        st.save_file = write_then_mark
    else:
        old = read_index(path)

        def half_then_die(tensors, filename, metadata=None):
            assert threading.current_thread() is not threading.main_thread()
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
        future = async_save(_Model(seed), path, file_format="safetensors", timeout_s=60)
        future.result()
    finally:
        st.save_file = real


def test_rank_dying_mid_async_write_leaves_the_previous_checkpoint_intact(run_on_ranks,
                                                                         tmp_path):
    ckpt = tmp_path / "ckpt"
    run_on_ranks(2, _save, str(ckpt), 0)
    with pytest.raises(DistributedError):
        run_on_ranks(2, _async_save_and_die_mid_write, str(ckpt), 1, str(tmp_path))
    crash = json.loads((tmp_path / "crash.json").read_text())
    assert crash["rank0_file"] and crash["rank0_file"] not in crash["old_files"], crash
    assert crash["rank0_file_on_disk"], crash
    assert crash["my_file"] not in crash["old_files"], crash
    assert 0 < crash["my_bytes_on_disk"] == crash["my_full_bytes"] // 2, crash
    assert crash["index_save_id_at_crash"] == crash["old_save_id"], crash
    assert read_index(ckpt)["save_id"] == crash["old_save_id"]
    for state in run_on_ranks(2, _load_full, str(ckpt)):
        torch.testing.assert_close(state, _values(0), rtol=0, atol=0)  # all old, no mix
    run_on_ranks(2, _save, str(ckpt), 2)  # the next save takes over and cleans up
    for state in run_on_ranks(2, _load_full, str(ckpt)):
        torch.testing.assert_close(state, _values(2), rtol=0, atol=0)


def _async_save_with_rank1_disk_full(path: str, seed: int) -> str:
    import safetensors.torch as st

    def disk_full(tensors, filename, metadata=None):
        raise OSError(28, "No space left on device", filename)

    real = st.save_file
    if get_platform().rank() == 1:
        st.save_file = disk_full
    try:
        future = async_save(_Model(seed), path, file_format="safetensors")
        future.result(timeout=120)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        st.save_file = real
    return "saved"


def test_a_rank_failing_its_background_write_fails_the_future_on_every_rank(run_on_ranks,
                                                                           tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    for error in run_on_ranks(2, _async_save_with_rank1_disk_full, str(tmp_path), 1):
        assert error.startswith("CheckpointError"), error
        assert "rank 1 could not write" in error and "No space left" in error, error
        assert "still holds the previous checkpoint" in error, error
    for state in run_on_ranks(2, _load_full, str(tmp_path)):
        torch.testing.assert_close(state, _values(0), rtol=0, atol=0)


def _two_saves_back_to_back(path: str) -> dict:
    """An async save still writing (held until the second save has been called) and then a
    second save into the same folder: the second waits for the first instead of refusing."""
    import safetensors.torch as st

    real, go = st.save_file, threading.Event()
    calls = []

    def held(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 1:
            go.wait(120)  # a bound, not a timing assertion
        real(tensors, filename, metadata=metadata)

    st.save_file = held
    try:
        first = async_save(_Model(1), path, file_format="safetensors")
        releaser = threading.Timer(0.5, go.set)  # lets the first write go while save waits
        releaser.start()
        save(_Model(2), path, file_format="safetensors")  # a ConcurrentSaveError without wait
        first_done = first.done()
        first_result = first.result(timeout=1)
    finally:
        st.save_file = real
    return {"first_done": first_done, "first_result": first_result,
            "files_written": len(calls)}


def test_a_second_save_waits_for_the_async_save_in_flight(run_on_ranks, tmp_path):
    run_on_ranks(2, _save, str(tmp_path), 0)
    for out in run_on_ranks(2, _two_saves_back_to_back, str(tmp_path)):
        assert out["first_done"] and out["files_written"] == 2, out
    for state in run_on_ranks(2, _load_full, str(tmp_path)):
        torch.testing.assert_close(state, _values(2), rtol=0, atol=0)
    names = sorted(os.listdir(tmp_path))
    index = read_index(tmp_path)
    assert names == sorted({"index.json", *index["files"]}), names  # no notes or old shards


def _async_save_with_optimizer(path: str) -> dict:
    model = _Model(3, with_buf=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    expected = {k: v.full_tensor() for k, v in model.state_dict().items()}
    exp_avg = opt.state[model.w]["exp_avg"].full_tensor()
    async_save(model, path, optimizer=opt).result(timeout=120)
    fresh = _Model(99, with_buf=False)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    load(fresh, path, optimizer=fresh_opt)
    return {"model": all(torch.equal(fresh.state_dict()[k].full_tensor(), v)
                         for k, v in expected.items()),
            "exp_avg": torch.equal(fresh_opt.state[fresh.w]["exp_avg"].full_tensor(), exp_avg),
            "lr": fresh_opt.param_groups[0]["lr"]}


def test_async_save_with_optimizer_round_trips(run_on_ranks, tmp_path):
    for out in run_on_ranks(2, _async_save_with_optimizer, str(tmp_path)):
        assert out == {"model": True, "exp_avg": True, "lr": 0.1}, out
