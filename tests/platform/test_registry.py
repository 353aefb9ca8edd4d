"""Backend discovery and selection: set_backend > HYPERPAR_BACKEND > auto-detect."""

from __future__ import annotations

import pytest

import hyperpar
from hyperpar.platform import BackendError, backends, get_platform, registry, selection_rule

DUMMY_BACKEND = """
from hyperpar.platform import hookimpl
from hyperpar_cpu.platform import CPUPlatform


class DummyPlatform(CPUPlatform):
    name = "{name}"
    priority = {priority}


@hookimpl
def hyperpar_backends():
    return [DummyPlatform]
"""

INCOMPLETE_BACKEND = """
from hyperpar.platform import Availability, Platform, hookimpl


class HalfPlatform(Platform):
    name = "half"
    device_type = "half"
    dist_backend = "none"

    @classmethod
    def is_available(cls):
        return Availability(True)


@hookimpl
def hyperpar_backends():
    return [HalfPlatform]
"""


def test_in_tree_backends_are_found_through_entry_points():
    found = backends()
    assert {"cpu", "cuda", "npu"} <= set(found)
    assert found["cpu"].distribution.startswith("hyperpar-cpu")


def test_auto_detect_picks_the_highest_priority_available_backend():
    available = [i for i in backends().values() if i.availability.ok]
    assert "cpu" in {i.name for i in available}, "cpu is always available"
    assert get_platform().name == max(available, key=lambda i: i.priority).name
    assert selection_rule().startswith("auto-detect")


def test_environment_variable_selects_the_backend(monkeypatch):
    monkeypatch.setenv("HYPERPAR_BACKEND", "cpu")
    assert get_platform().name == "cpu"
    assert selection_rule() == "HYPERPAR_BACKEND=cpu"


def test_unknown_backend_name_lists_installed_backends(monkeypatch):
    monkeypatch.setenv("HYPERPAR_BACKEND", "nonsense")
    with pytest.raises(BackendError) as err:
        get_platform()
    message = str(err.value)
    assert "'nonsense'" in message
    for name in ("cpu", "cuda", "npu"):
        assert name in message


def test_npu_without_torch_npu_explains_the_import_failure():
    with pytest.raises(BackendError, match="torch_npu import failed"):
        hyperpar.set_backend("npu")


def test_cuda_on_a_cpu_build_of_torch_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a usable CUDA device (the check is for CPU-only hosts)")
    with pytest.raises(BackendError, match="no CUDA support|no cuda device visible"):
        hyperpar.set_backend("cuda")


def test_set_backend_overrides_the_environment(monkeypatch, install_distribution):
    install_distribution("hyperpar-dummy", "hyperpar_dummy",
                         DUMMY_BACKEND.format(name="dummy", priority=-1))
    monkeypatch.setenv("HYPERPAR_BACKEND", "cpu")
    hyperpar.set_backend("dummy")
    assert get_platform().name == "dummy"
    assert selection_rule() == "hyperpar.set_backend()"
    hyperpar.set_backend(None)
    assert get_platform().name == "cpu"


def test_selection_is_lazy_and_reset_forgets_it(monkeypatch):
    first = get_platform()
    assert get_platform() is first, "the platform is cached between calls"
    registry.reset()
    assert get_platform() is not first


def test_third_party_backend_is_discovered_and_auto_selected_by_priority(install_distribution,
                                                                        monkeypatch):
    # Above every in-tree backend (cuda is 100), so the check holds on a GPU host too.
    monkeypatch.delenv("HYPERPAR_BACKEND", raising=False)
    install_distribution("hyperpar-dummy", "hyperpar_dummy",
                         DUMMY_BACKEND.format(name="dummy", priority=1000))
    found = backends()
    assert found["dummy"].distribution == "hyperpar-dummy 0.1"
    assert get_platform().name == "dummy", "the highest priority available backend"


def test_two_plugins_claiming_one_name_name_both_distributions(install_distribution):
    install_distribution("hyperpar-dummy-clash", "hyperpar_dummy_clash",
                         DUMMY_BACKEND.format(name="cpu", priority=1))
    with pytest.raises(BackendError) as err:
        backends()
    assert "hyperpar-cpu" in str(err.value) and "hyperpar-dummy-clash" in str(err.value)


def test_backend_missing_abstract_members_fails_at_registration(install_distribution):
    install_distribution("hyperpar-dummy-half", "hyperpar_dummy_half", INCOMPLETE_BACKEND)
    with pytest.raises(BackendError) as err:
        backends()
    message = str(err.value)
    assert "hyperpar-dummy-half" in message and "all_reduce" in message


def test_backend_with_a_non_integer_priority_is_rejected(install_distribution):
    install_distribution("hyperpar-dummy-prio", "hyperpar_dummy_prio",
                         DUMMY_BACKEND.format(name="dummyprio", priority='"high"'))
    with pytest.raises(BackendError, match="priority must be an int"):
        backends()


def test_runtime_registered_plugin_is_selectable():
    from hyperpar_cpu.platform import CPUPlatform

    from hyperpar.platform import hookimpl, register_plugin, unregister_plugin

    class NotebookPlatform(CPUPlatform):
        name = "notebook"

    class Plugin:
        @hookimpl
        def hyperpar_backends(self):
            return [NotebookPlatform]

    plugin = Plugin()
    register_plugin(plugin, source="a notebook")
    try:
        assert backends()["notebook"].distribution == "a notebook"
        assert hyperpar.set_backend("notebook").name == "notebook"
    finally:
        unregister_plugin(plugin)
    assert "notebook" not in backends()


def _selected_backend_name() -> str:
    from hyperpar.platform import get_platform

    return get_platform().name


def test_third_party_backend_runs_collectives_in_spawned_ranks(install_distribution):
    install_distribution("hyperpar-dummy", "hyperpar_dummy",
                         DUMMY_BACKEND.format(name="dummy", priority=-1))
    from hyperpar.testing import run_distributed

    assert run_distributed(_selected_backend_name, 2, backend="dummy") == ["dummy", "dummy"]


def test_a_plugin_that_fails_to_import_is_named_with_its_distribution(install_distribution):
    install_distribution("hyperpar-dummy-broken", "hyperpar_dummy_broken",
                         "raise ImportError('libfoo.so: cannot open shared object file')")
    with pytest.raises(BackendError) as err:
        backends()
    message = str(err.value)
    assert "hyperpar-dummy-broken" in message and "libfoo.so" in message
