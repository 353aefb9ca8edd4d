"""Device-aware processes: a backend with one device per rank refuses more ranks than visible
devices with a clear hyperpar error -- in ``init_process_group`` on every rank, and in
``hyperpar run`` before anything is spawned -- while host backends take any number."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist
from hyperpar_cpu.platform import CPUPlatform
from hyperpar_cuda.platform import CUDAPlatform

from hyperpar.launcher import LaunchOptions, launch
from hyperpar.platform import DeviceCapacityError, hookimpl, register_plugin, unregister_plugin
from hyperpar.testing import DistributedError, WorkerPool
from hyperpar.testing.emulation import install_npu_emulation


class OneGPU(CUDAPlatform):
    """The cuda backend as a one-GPU host sees it (no GPU needed: only the count is faked)."""

    def device_count(self) -> int:
        return 1


class OneDeviceHost(CPUPlatform):
    """A host backend that declares one device per rank, to drive ``hyperpar run``."""

    name = "onedevice"
    ranks_share_device = False


def test_host_backends_take_any_number_of_ranks():
    assert CPUPlatform.ranks_share_device
    assert CPUPlatform().max_local_ranks() is None
    CPUPlatform().check_world_fits(64)


def test_device_backends_host_one_rank_per_visible_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert not CUDAPlatform.ranks_share_device
    assert OneGPU().max_local_ranks() == 1
    OneGPU().check_world_fits(1)
    with pytest.raises(DeviceCapacityError) as err:
        OneGPU().check_world_fits(2)
    assert str(err.value) == (
        "2 ranks but 1 cuda device visible: NCCL needs one device per rank; run with -n 1, make "
        "more devices visible, or use the cpu backend")


def test_refusal_shows_the_visible_devices_variable(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(DeviceCapacityError, match=r"\(CUDA_VISIBLE_DEVICES='3'\)"):
        OneGPU().check_world_fits(4)


def test_init_process_group_refuses_before_joining(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(DeviceCapacityError, match="2 ranks but 1 cuda device visible"):
        OneGPU().init_process_group(rank=0, world_size=2, init_method="tcp://127.0.0.1:1")
    assert not dist.is_initialized()


def _never_runs() -> None:
    raise AssertionError("the ranks must not get past init_process_group")


def test_emulated_one_device_npu_refuses_two_ranks_on_every_rank():
    pool = WorkerPool(2, backend="npu", setup=install_npu_emulation,
                      env={"ASCEND_RT_VISIBLE_DEVICES": "0"}, start_timeout_s=300)
    with pool, pytest.raises(DistributedError) as err:
        pool.run(_never_runs)
    assert ("2 ranks but 1 npu device visible (ASCEND_RT_VISIBLE_DEVICES='0'): HCCL needs one "
            "device per rank; run with -n 1") in str(err.value)


def test_hyperpar_run_refuses_before_spawning(tmp_path, capsys):
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")

    class Plugin:
        @hookimpl
        def hyperpar_backends(self):
            return [OneDeviceHost]

    plugin = Plugin()
    register_plugin(plugin, source="test")
    try:
        code = launch(LaunchOptions(script=str(script), nproc_per_node="2",
                                    backend="onedevice", quiet=True))
    finally:
        unregister_plugin(plugin)
    assert code == 2 and not marker.exists()
    assert ("hyperpar run: error: 2 ranks but 1 cpu device visible: GLOO needs one device per "
            "rank; run with -n 1") in capsys.readouterr().err


def test_conformance_kit_passes_on_an_emulated_one_device_npu():
    """The done-criterion of device-aware processes: with one visible npu the kit runs at world
    size 1, green, and skips the larger worlds with the reason."""
    env = dict(os.environ, ASCEND_RT_VISIBLE_DEVICES="0")
    env.pop("HYPERPAR_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs", "--pyargs",
         "hyperpar.testing.conformance", "--hyperpar-backend=npu", "--hyperpar-emulate"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "failed" not in out and " passed" in out
    assert "needs 2 ranks; backend npu runs one rank per device and 1 npu device(s)" in out
    one_rank = [line for line in out.splitlines() if "[1ranks" in line and "::" in line]
    needs_a_peer = ("point_to_point", "sub_groups")
    assert len(one_rank) >= 25  # 27 today: every world-size-parametrised check
    for line in one_rank:
        expected = "SKIPPED" if any(k in line for k in needs_a_peer) else "PASSED"
        assert expected in line, line


def test_info_reports_how_many_ranks_a_host_runs(monkeypatch):
    from hyperpar.platform.info import collect_info

    monkeypatch.setenv("HYPERPAR_BACKEND", "cpu")
    report = collect_info()
    assert report.max_local_ranks is None
    assert "ranks per host: any (ranks share the device)" in report.to_text()
    report.max_local_ranks = 1
    assert "ranks per host: up to 1 (one per device)" in report.to_text()
