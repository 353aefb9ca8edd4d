"""`hyperpar run` refuses a bad HYPERPAR_TIMEOUT and warns when -n oversubscribes the cores."""

from __future__ import annotations

from hyperpar.cli import oversubscription_warning, usable_cores

from .conftest import REPO, hyperpar_cmd


def test_more_cpu_workers_than_cores_is_warned_about():
    message = oversubscription_warning("4096", "cpu", cores=2)
    assert message is not None
    assert "-n 4096" in message and "2 CPU core(s)" in message and "-n 2" in message


def test_workers_within_the_core_count_are_not_warned_about():
    assert oversubscription_warning("2", "cpu", cores=2) is None
    assert oversubscription_warning("auto", "cpu", cores=2) is None


def test_device_backends_are_left_to_their_own_device_check():
    assert oversubscription_warning("4096", "cuda", cores=2) is None


def test_run_prints_the_warning_before_launching():
    # A missing script: the launcher stops before starting any worker, after the warning.
    too_many = str(usable_cores() + 1)
    proc = hyperpar_cmd("run", "-n", too_many, "--backend", "cpu", "no_such_script.py")
    assert proc.returncode == 2
    assert f"warning: -n {too_many} starts {too_many} worker processes" in proc.stderr


def test_a_non_numeric_timeout_variable_is_named_before_launching():
    script = REPO / "examples" / "collectives_smoke.py"
    proc = hyperpar_cmd("run", "-n", "2", "--backend", "cpu", str(script),
                        env={"HYPERPAR_TIMEOUT": "abc"})
    assert proc.returncode == 2
    assert "HYPERPAR_TIMEOUT='abc'" in proc.stderr and "positive number of seconds" in proc.stderr
    assert "could not convert" not in proc.stderr
