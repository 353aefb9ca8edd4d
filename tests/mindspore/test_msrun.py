"""MindSpore as its users launch it: msrun, several nodes, ops before the mesh, Ascend's device pin.

Every job here is real processes (MindSpore's scheduler and workers); each is bounded by a timeout
so a hang fails. msrun stops its workers on SIGINT only, hence ``timeout -s INT`` around it.
The example's parity check is its own: rank 0 trains an unsharded copy in-process and prints the
largest loss difference; float32 sums over 2 ranks differ by rounding only (~1e-7 seen, 1e-5
allowed, while a wrong shard or a missing all-reduce changes the loss by O(1e-2) or more).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hyperpar_mindspore.launch_env import ranks_needed_here, read_launch_env

from hyperpar.testing.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mindspore_tp_mlp.py"
FSDP_EXAMPLE = ROOT / "examples" / "mindspore_fully_shard_mlp.py"
JOB_TIMEOUT_S = 480


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HYPERPAR_BACKEND="mindspore", GLOG_v="3", **extra)
    env.pop("HYPERPAR_MS_DEVICE", None)
    # msrun starts workers with plain `python`: this venv's must come first.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _msrun(script: Path, cwd: Path, n: int = 2, args: tuple[str, ...] = (),
           **extra: str) -> list[str]:
    """Run ``script args`` under msrun on ``n`` local CPU workers; return each worker's log."""
    log_dir = cwd / "msrun-logs"
    cmd = ["timeout", "-s", "INT", str(JOB_TIMEOUT_S),
           os.path.join(os.path.dirname(sys.executable), "msrun"),
           f"--worker_num={n}", f"--local_worker_num={n}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "--join=True", "--cluster_time_out=300",
           f"--log_dir={log_dir}", str(script), *args]
    done = subprocess.run(cmd, cwd=cwd, env=_env(**extra), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S + 60)
    logs = [(log_dir / f"worker_{r}.log").read_text() for r in range(n)
            if (log_dir / f"worker_{r}.log").exists()]
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:],
                                  [g[-3000:] for g in logs])
    return logs


def _loss_difference(text: str) -> float:
    found = re.findall(r"largest loss difference vs one process: (\S+)", text)
    assert len(found) == 1, text[-3000:]
    return float(found[0])


# ---------------------------------------------------------------- the launchers' variables
MSRUN_RANK1 = {"MS_ROLE": "MS_WORKER", "MS_NODE_ID": "3", "RANK_ID": "3", "MS_WORKER_NUM": "4",
               "RANK_SIZE": "4", "DEVICE_ID": "1", "MS_SCHED_HOST": "10.0.0.1",
               "MS_SCHED_PORT": "8118"}  # what msrun set on node 1 of 2 (measured, 2 nodes x 2)


def test_msrun_variables_give_rank_world_and_device():
    launch = read_launch_env(MSRUN_RANK1)
    assert (launch.launcher, launch.rank, launch.world_size) == ("msrun", 3, 4)
    assert (launch.local_rank, launch.device_id, launch.local_world_size) == (1, 1, None)
    # A multi-node msrun must not be checked against the whole world (4 > 2 devices here).
    assert ranks_needed_here(launch) == 2


def test_hyperpar_run_variables_and_a_world_of_one():
    launch = read_launch_env({"MS_ROLE": "MS_WORKER", "MS_NODE_ID": "2", "RANK": "2",
                              "MS_WORKER_NUM": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                              "DEVICE_ID": "0", "LOCAL_WORLD_SIZE": "2",
                              "HYPERPAR_MS_PARENT": "1"})
    assert (launch.launcher, launch.rank, launch.world_size, launch.device_id) == (
        "hyperpar run", 2, 4, 0)
    assert ranks_needed_here(launch) == 2
    alone = read_launch_env({})
    assert (alone.launcher, alone.rank, alone.world_size, alone.device_id) == ("none", 0, 1, 0)


@pytest.mark.parametrize("bad, named", [({"DEVICE_ID": "npu1"}, "DEVICE_ID='npu1'"),
                                        ({"RANK_ID": "2", "RANK_SIZE": "2"}, "rank 2 of a world")])
def test_malformed_launcher_variables_are_named(bad, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        read_launch_env({"MS_ROLE": "MS_WORKER", **bad})


# ---------------------------------------------------------------- real jobs
# The example unchanged, its step in PyNative mode or compiled (``--jit``: ms.jit around the
# whole step, so the graph's ops.AllReduce / ops.AllGather run on the launcher's groups).
MODES = {"pynative": ((), "mode: PyNative"), "jit": (("--jit",), "mode: ms.jit")}

#: The launcher does not depend on the mode (it sets variables and starts processes; the mode is
#: the script's), so by default each example runs each launcher once and each mode once, not the
#: cross product (~35 s per job on 2 cores; the CI suite is near its time limit).
#: ``HYPERPAR_MS_LAUNCHER_ALL=1`` runs every launcher x mode pair.
ALL_PAIRS = os.environ.get("HYPERPAR_MS_LAUNCHER_ALL") == "1"


def _pairs(default: list[str]) -> list:
    """``default`` modes, or every mode under ``HYPERPAR_MS_LAUNCHER_ALL=1``."""
    return sorted(MODES) if ALL_PAIRS else default


@pytest.mark.parametrize("mode", _pairs(["jit"]))
def test_tp_example_under_msrun(tmp_path, mode):
    args, says = MODES[mode]
    logs = _msrun(EXAMPLE, tmp_path, args=args)
    assert says in logs[0], logs[0][-3000:]
    assert _loss_difference(logs[0]) < 1e-5
    assert "fc1.weight on rank 0: (64, 32) of (128, 32)" in logs[0]


def _two_nodes(script: Path, cwd: Path, args: tuple[str, ...]) -> list[tuple[str, str]]:
    """``script args`` under two `hyperpar run` launchers on localhost, as two nodes of one rank
    would run it; each node's (stdout, stderr)."""
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-c", "import sys; from hyperpar.cli import main; sys.exit(main())",
           "run", "-n", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint]
    nodes = [subprocess.Popen([*cmd, "--node-rank", str(r), str(script), *args], cwd=cwd,
                              env=_env(HYPERPAR_MS_DEVICE="CPU"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=JOB_TIMEOUT_S) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    assert "node 0 of 2" in "".join(outs[0]) and "node 1 of 2" in "".join(outs[1])
    return outs


@pytest.mark.parametrize("mode", _pairs(["pynative"]))
def test_tp_example_on_two_nodes_of_one_rank(tmp_path, mode):
    """Two `hyperpar run` launchers on localhost, as two nodes would run them."""
    args, says = MODES[mode]
    outs = _two_nodes(EXAMPLE, tmp_path, args)
    assert says in outs[0][0], outs[0][0][-3000:]
    assert _loss_difference(outs[0][0]) < 1e-5  # global rank 0 runs on node 0


def _parameter_difference(text: str) -> float:
    found = re.findall(r"largest parameter difference vs one process: (\S+)", text)
    assert len(found) == 1, text[-3000:]
    return float(found[0])


@pytest.mark.parametrize("launcher, mode", [("msrun", "pynative"), ("two-nodes", "jit")]
                         + ([("msrun", "jit"), ("two-nodes", "pynative")] if ALL_PAIRS else []))
def test_fully_shard_example_under_the_launchers(tmp_path, launcher, mode):
    """The fully_shard example unchanged, in PyNative or with its step under ms.jit
    (all-gathers and averaging reduce-scatters in the graph), under msrun and as two nodes:
    every parameter after 4 SGD steps on each rank's rows matches one process on the whole
    batch (float32 rounding; a missing average or a wrong shard moves them by O(1e-2)).
    (PyNative as two nodes is the TP example's path: the launcher does not depend on the mode.)"""
    args, says = MODES[mode]
    if launcher == "msrun":
        text = _msrun(FSDP_EXAMPLE, tmp_path, args=args)[0]
    else:
        text = _two_nodes(FSDP_EXAMPLE, tmp_path, args)[0][0]
    assert says in text, text[-3000:]
    assert "fc1.weight on rank 0: (32, 16) of (64, 16)" in text, text[-3000:]
    assert _parameter_difference(text) < 1e-5


def test_multi_node_options_are_checked_before_anything_starts(tmp_path):
    cmd = [sys.executable, "-c", "import sys; from hyperpar.cli import main; sys.exit(main())",
           "run", "-n", "1", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint",
           "127.0.0.1:1", str(EXAMPLE)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--node-rank 2 must be in 0..1 for --nnodes 2" in done.stdout + done.stderr


OPS_FIRST = """
import mindspore as ms
import numpy as np
from hyperpar import init_device_mesh
from hyperpar.platform import get_platform

warm = ms.Tensor(np.ones(3, np.float32)) * 2       # a kernel runs before the mesh exists
mesh = init_device_mesh((2,), mesh_dim_names=("tp",))
p = get_platform()
x = ms.Tensor([float(p.rank() + 1)]) + warm.sum()
p.all_reduce(x)
print(f"OPS-FIRST rank {p.rank()} sum {x.asnumpy()[0]:.1f}", flush=True)
"""


def test_ops_before_init_device_mesh(tmp_path):
    script = tmp_path / "ops_first.py"
    script.write_text(textwrap.dedent(OPS_FIRST))
    cmd = [sys.executable, "-c", "import sys; from hyperpar.cli import main; sys.exit(main())",
           "run", "-n", "2", str(script)]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(HYPERPAR_MS_DEVICE="CPU"),
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # (1 + 6) + (2 + 6): each rank's own value plus the warm-up sum, all-reduced.
    # the ranks share the launcher's stdout: print's text and its newline are two writes, so
    # one rank's line can run into the other's (seen: "sum 15.0OPS-FIRST rank 0 ...")
    assert sorted(re.findall(r"OPS-FIRST rank (\d) sum (\d+\.\d)", done.stdout)) == [
        ("0", "15.0"), ("1", "15.0")]


EMULATED_ASCEND = """
import os
import mindspore as ms

# The emulation: MindSpore is told the target is Ascend; set_device records what hyperpar asks
# for and then takes the CPU; a forced blocking launch is recorded instead of applied.
asked, blocking = [], []
real_set_device = ms.set_device
def set_device(target, device_id=None):
    asked.append((target, device_id))
    real_set_device("CPU")
ms.set_device = set_device
ms.runtime.launch_blocking = lambda: blocking.append(True)
ms.hal.device_count = lambda target=None: 2
os.environ["HYPERPAR_MS_DEVICE"] = "Ascend"

from hyperpar.platform import get_platform
p = get_platform()
p.init_process_group()
x = ms.Tensor([float(p.rank() + 1)])
p.all_reduce(x)
print(f"EMULATED rank {p.rank()} target {p.target} asked {asked} current {p.current_device()} "
      f"blocking {len(blocking)} settings {p.runtime_settings()} sum {x.asnumpy()[0]:.0f}",
      flush=True)
"""


def test_emulated_ascend_under_msrun_pins_each_rank_and_keeps_launches_async(tmp_path):
    script = tmp_path / "emulated_ascend.py"
    script.write_text(textwrap.dedent(EMULATED_ASCEND))
    logs = _msrun(script, tmp_path)
    for rank, log in enumerate(logs):
        line = re.findall(r"EMULATED rank .*", log)
        assert len(line) == 1, log[-3000:]
        assert (f"EMULATED rank {rank} target Ascend asked [('Ascend', {rank})] "
                f"current {rank} blocking 0") in line[0]
        assert "asynchronous" in line[0] and line[0].endswith("sum 3")


# ---------------------------------------------------------------- in this process
def test_info_shows_the_tuning_of_each_target(monkeypatch):
    from hyperpar_mindspore.platform import MindSporePlatform

    from hyperpar.platform import registry
    from hyperpar.platform.info import collect_info

    monkeypatch.delenv("HYPERPAR_MS_KEEP_THREADS", raising=False)
    monkeypatch.setenv("HYPERPAR_BACKEND", "mindspore")
    monkeypatch.setenv("HYPERPAR_MS_DEVICE", "CPU")
    registry.reset()
    try:
        text = collect_info().to_text()
    finally:
        registry.reset()
    assert "runtime settings: op threads 1, dispatch threads 1, kernel launches blocking" in text
    monkeypatch.setenv("HYPERPAR_MS_DEVICE", "Ascend")  # only read: no device is touched
    monkeypatch.setenv("MS_OM_PATH", "/chosen/by/the/user")
    assert MindSporePlatform().runtime_settings() == {
        "kernel launches": "asynchronous (MindSpore's default)",
        "compiler output (MS_OM_PATH)": "/chosen/by/the/user"}


def test_a_world_of_one_after_ops_ran(monkeypatch):
    import mindspore as ms
    from hyperpar_mindspore.platform import MindSporePlatform

    for var in ("MS_ROLE", "WORLD_SIZE", "MS_WORKER_NUM", "RANK", "RANK_SIZE", "DEVICE_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HYPERPAR_MS_DEVICE", "CPU")
    assert float((ms.Tensor([1.0]) + 1).asnumpy()[0]) == 2.0  # the runtime starts here
    p = MindSporePlatform()
    p.init_process_group()
    assert (p.rank(), p.world_size()) == (0, 1)
    p.destroy_process_group()
