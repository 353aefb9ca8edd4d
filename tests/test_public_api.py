"""Every name hyperpar advertises resolves, and importing hyperpar resolves no backend."""

import subprocess
import sys

import hyperpar


def test_every_name_in_all_resolves():
    missing = [name for name in hyperpar.__all__ if getattr(hyperpar, name, None) is None]
    assert not missing, missing


def test_public_names_are_documented():
    undocumented = [
        name for name in hyperpar.__all__
        if not name.startswith("__") and callable(getattr(hyperpar, name))
        and not getattr(hyperpar, name).__doc__
    ]
    assert not undocumented, undocumented


def test_import_does_not_select_a_backend():
    code = ("import hyperpar, hyperpar.parallel, hyperpar.pipeline, hyperpar.dtensor\n"
            "from hyperpar.platform import registry\n"
            "assert registry._state.platform is None and registry._state.backends is None\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_attribute_is_an_attribute_error():
    try:
        hyperpar.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")
