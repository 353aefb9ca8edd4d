"""The multi-process harness fails fast and says which rank failed and why."""

from __future__ import annotations

import os
import time

import pytest
import torch

from hyperpar.platform import get_platform
from hyperpar.testing import DistributedError, WorkerPool, run_distributed


def _rank_and_world() -> tuple[int, int]:
    p = get_platform()
    return p.rank(), p.world_size()


def _rank_one_raises() -> None:
    p = get_platform()
    if p.rank() == 1:
        raise ValueError("rank one cannot continue: bad shard")
    t = torch.ones(1)
    p.all_reduce(t)  # rank 0 waits here for a peer that never comes


def _rank_one_skips_the_collective() -> None:
    p = get_platform()
    if p.rank() == 0:
        p.all_reduce(torch.ones(1))
    else:
        time.sleep(30)


def _rank_one_dies() -> None:
    if get_platform().rank() == 1:
        os._exit(3)
    time.sleep(30)


def test_results_come_back_in_rank_order():
    assert run_distributed(_rank_and_world, 4) == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_a_rank_that_raises_fails_the_call_with_its_rank_and_message():
    # No timing assertion: had the call waited for rank 0's collective instead of failing at
    # once, it would end in the call's own timeout ("timed out after ...") and not in rank 1's
    # error, which the message checks below would catch.
    with pytest.raises(DistributedError) as err:
        run_distributed(_rank_one_raises, 2, timeout_s=60)
    assert err.value.rank == 1
    assert "rank 1 of 2 raised" in str(err.value)
    assert "rank one cannot continue: bad shard" in str(err.value)
    assert "timed out" not in str(err.value)


def test_a_collective_that_never_completes_blames_the_rank_that_did_not_reach_it():
    with WorkerPool(2, collective_timeout_s=3) as pool, pytest.raises(DistributedError) as err:
        pool.run(_rank_one_skips_the_collective, timeout_s=60)
    assert err.value.rank == 1, "rank 0 timed out waiting; rank 1 is the one behind"
    assert "rank 1 did not reach all_reduce #1 (rank 0 waited" in str(err.value)


def test_a_rank_that_dies_is_reported_with_its_exit_code():
    with pytest.raises(DistributedError, match=r"rank 1 died \(exit code 3\)"):
        run_distributed(_rank_one_dies, 2, timeout_s=60)


def test_pool_timeout_names_the_ranks_still_running():
    with WorkerPool(2, collective_timeout_s=60) as pool:
        with pytest.raises(DistributedError, match=r"timed out after 2 s; ranks \[0, 1\]"):
            pool.run(time.sleep, 20, timeout_s=2)
        assert pool.run(_rank_and_world) == [(0, 2), (1, 2)], "the pool restarts after a failure"


def _returns_a_tensor_that_requires_grad() -> torch.Tensor:
    return torch.ones(2, requires_grad=True) * 2


def _returns_a_lock():
    import threading

    return threading.Lock()


def test_a_tensor_that_requires_grad_comes_back_by_value():
    results = run_distributed(_returns_a_tensor_that_requires_grad, 2, timeout_s=60)
    assert [r.tolist() for r in results] == [[2.0, 2.0], [2.0, 2.0]]


def test_an_unpicklable_result_fails_at_once_with_the_rank():
    with pytest.raises(DistributedError, match=r"rank [01] of 2 raised(.|\n)*cannot pickle"):
        run_distributed(_returns_a_lock, 2, timeout_s=60)


def test_an_unpicklable_function_is_refused_before_any_rank_starts():
    with pytest.raises(DistributedError, match="module level"):
        run_distributed(lambda: 1, 2, timeout_s=60)


_ORPHAN_SCRIPT = """
import os, signal
from hyperpar.testing import WorkerPool

pool = WorkerPool(2, collective_timeout_s=30.0)
print(" ".join(str(pid) for pid in pool.run(os.getpid)), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the parent dies without closing the pool
"""


def test_workers_exit_when_the_process_that_started_them_is_killed(tmp_path):
    import subprocess
    import sys

    # A file, not a pipe: orphaned workers would hold a pipe open and make run() wait.
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT], stdout=out,
                       stderr=subprocess.STDOUT, timeout=180)
    text = log.read_text()
    pids = [int(p) for p in text.split()[-2:] if p.isdigit()]
    assert len(pids) == 2, text

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # A zombie (exited, not yet reaped by init) counts as gone.
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:  # do not leave them behind if the check fails
        os.kill(p, 9)
    assert not left, f"worker processes {left} outlived their parent"
