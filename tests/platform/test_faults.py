"""Faults outside hyperpar's control are named: a plugin hook that raises, a bad timeout."""

from __future__ import annotations

import pytest

from hyperpar.platform import BackendError, backends
from hyperpar.platform.timeout import default_timeout_s

RAISING_HOOK = """
from hyperpar.platform import hookimpl


@hookimpl
def hyperpar_backends():
    return [{}["missing"]]
"""


def test_a_plugin_whose_hook_raises_is_named_with_its_distribution(install_distribution):
    install_distribution("hyperpar-dummy-raises", "hyperpar_dummy_raises", RAISING_HOOK)
    with pytest.raises(BackendError) as err:
        backends()
    message = str(err.value)
    assert "hyperpar_dummy_raises" in message and "hyperpar-dummy-raises 0.1" in message
    assert "KeyError" in message and "'missing'" in message


def test_a_plugin_whose_hook_returns_a_non_list_is_named(install_distribution):
    install_distribution("hyperpar-dummy-scalar", "hyperpar_dummy_scalar",
                         RAISING_HOOK.replace('[{}["missing"]]', "42"))
    with pytest.raises(BackendError, match="hyperpar-dummy-scalar 0.1.*must return a list"):
        backends()


@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan", "inf"])
def test_a_bad_timeout_variable_is_named_with_what_is_accepted(monkeypatch, value):
    monkeypatch.setenv("HYPERPAR_TIMEOUT", value)
    with pytest.raises(ValueError) as err:
        default_timeout_s()
    assert f"HYPERPAR_TIMEOUT={value!r}" in str(err.value)
    assert "positive number of seconds" in str(err.value)


def test_the_timeout_variable_accepts_seconds_and_defaults_to_300(monkeypatch):
    monkeypatch.setenv("HYPERPAR_TIMEOUT", " 12.5 ")
    assert default_timeout_s() == 12.5
    monkeypatch.delenv("HYPERPAR_TIMEOUT")
    assert default_timeout_s() == 300.0
