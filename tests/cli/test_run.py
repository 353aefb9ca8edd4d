"""`hyperpar run`: torchrun's argument list, early validation, and real launches."""

from __future__ import annotations

import textwrap

import pytest

from hyperpar.launcher import LaunchError, LaunchOptions, launch, torchrun_args, worker_env
from hyperpar.testing import free_port

from .conftest import REPO, hyperpar_cmd, hyperpar_popen


def test_single_node_run_uses_standalone_rendezvous():
    args = torchrun_args(LaunchOptions(script="train.py", script_args=["--lr", "1"],
                                       nproc_per_node="2"))
    assert "--standalone" in args and "--rdzv-endpoint" not in args
    assert args[-5:] == ["--module", "hyperpar.launcher", "train.py", "--lr", "1"]


def test_multi_node_run_passes_the_rendezvous_through():
    args = torchrun_args(LaunchOptions(script="train.py", nnodes="2", node_rank=1,
                                       rdzv_endpoint="host:29400", rdzv_id="job7"))
    assert "--standalone" not in args
    assert args[args.index("--rdzv-endpoint") + 1] == "host:29400"
    assert args[args.index("--rdzv-id") + 1] == "job7"
    assert args[args.index("--nnodes") + 1] == "2"


def test_module_mode_runs_the_module_through_the_worker_entry():
    args = torchrun_args(LaunchOptions(script="pkg.train", module=True))
    assert args[-4:] == ["--module", "hyperpar.launcher", "-m", "pkg.train"]


def test_multi_node_without_rendezvous_endpoint_is_an_error():
    with pytest.raises(LaunchError, match="--rdzv-endpoint"):
        torchrun_args(LaunchOptions(script="train.py", nnodes="2"))


def test_devices_set_the_backends_visible_devices_variable():
    env = worker_env("cuda", "0, 1", quiet=True)
    assert env == {"HYPERPAR_BACKEND": "cuda", "CUDA_VISIBLE_DEVICES": "0,1",
                   "HYPERPAR_QUIET": "1"}


def test_devices_on_a_backend_without_devices_is_an_error():
    with pytest.raises(LaunchError, match="backend 'cpu' has no visible-devices variable"):
        worker_env("cpu", "0,1", quiet=False)


def test_unknown_backend_fails_before_launching_and_lists_installed(capsys):
    script = REPO / "examples" / "collectives_smoke.py"
    assert launch(LaunchOptions(script=str(script), backend="nonsense")) == 2
    err = capsys.readouterr().err
    assert "unknown hyperpar backend 'nonsense'" in err and "cpu (hyperpar-cpu" in err


def test_run_collectives_smoke_on_two_cpu_ranks_quietly():
    proc = hyperpar_cmd("run", "-n", "2", "--quiet", "--backend", "cpu",
                        "examples/collectives_smoke.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 1/2 all_reduce     [3.0, 3.0]" in proc.stdout
    assert "OK: cpu" in proc.stdout
    assert "hyperpar run:" not in proc.stderr  # --quiet: no launcher banner
    assert "OMP_NUM_THREADS" not in proc.stderr  # nor torchrun's


def test_failing_worker_fails_the_run_with_its_rank_and_error_last(tmp_path):
    script = tmp_path / "fails_on_rank_1.py"
    script.write_text(textwrap.dedent("""
        from hyperpar.platform import get_platform

        def load_shard():
            raise ValueError("shard 1 is corrupt")

        platform = get_platform()
        platform.init_process_group()
        if platform.rank() == 1:
            load_shard()
        platform.barrier()
    """))
    proc = hyperpar_cmd("run", "-n", "2", "--quiet", "--backend", "cpu", str(script))
    assert proc.returncode == 1
    tail = proc.stderr.rstrip().splitlines()[-12:]
    text = "\n".join(tail)
    assert "first failure: rank 1 (local rank 1), exit code 1" in text
    assert 'in load_shard\n    raise ValueError("shard 1 is corrupt")' in text
    assert tail[-2] == "rank 1: ValueError: shard 1 is corrupt"
    assert "hyperpar/launcher.py" not in text  # the launcher's own frames are trimmed


def test_two_nodes_meet_at_the_rendezvous_endpoint_running_a_module():
    """Two launchers (one per "node", here both on localhost) form one 2-rank job, as two
    torchrun invocations with the same --rdzv-endpoint would; the target is given as a module
    (``-m``), resolved from the working directory as ``python -m`` does."""
    port = free_port()
    common = ["run", "--nnodes", "2", "-n", "1", "--quiet", "--backend", "cpu",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "cli-test",
              "-m", "examples.collectives_smoke"]
    nodes = [hyperpar_popen(*common) for _ in range(2)]
    outs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs
    stdout = "".join(out for out, _ in outs)
    assert "rank 0/2 broadcast" in stdout and "rank 1/2 broadcast" in stdout
    assert "OK: cpu" in stdout
