"""`hyperpar info`: the report, `--check`, `--json` and the global `--backend`."""

from __future__ import annotations

import json

from hyperpar.cli import main

from .conftest import hyperpar_cmd


def test_info_names_installed_backends_selection_rule_and_fallbacks(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "installed backends:" in out
    for name in ("cpu", "cuda", "npu"):
        assert f" {name} " in out
    assert "selected: cpu  (by auto-detect (highest priority available))" in out
    assert "collective fallbacks in use:" in out


def test_info_check_fails_for_unknown_backend_naming_installed_ones(capsys, monkeypatch):
    monkeypatch.setenv("HYPERPAR_BACKEND", "nonsense")
    assert main(["info", "--check"]) == 1
    captured = capsys.readouterr()
    assert "installed backends:" in captured.out  # the report is still printed
    assert "unknown hyperpar backend 'nonsense'" in captured.err
    assert "cpu (hyperpar-cpu" in captured.err


def test_info_without_check_exits_zero_for_a_bad_selection(capsys, monkeypatch):
    monkeypatch.setenv("HYPERPAR_BACKEND", "nonsense")
    assert main(["info"]) == 0
    assert "selected: none -- unknown hyperpar backend 'nonsense'" in capsys.readouterr().out


def test_info_explains_that_torch_npu_is_missing(capsys, monkeypatch):
    monkeypatch.setenv("HYPERPAR_BACKEND", "npu")
    assert main(["info", "--check"]) == 1
    out = capsys.readouterr().out
    assert "npu" in out and "torch_npu import failed" in out


def test_global_backend_option_selects_the_backend(capsys):
    assert main(["--backend", "cpu", "info"]) == 0
    assert "selected: cpu  (by HYPERPAR_BACKEND=cpu)" in capsys.readouterr().out


def test_backend_option_after_the_subcommand_works_too(capsys):
    assert main(["info", "--backend", "nonsense", "--check"]) == 1
    assert "unknown hyperpar backend 'nonsense'" in capsys.readouterr().err


def test_info_json_is_the_report_as_data(capsys):
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["selected"] == "cpu"
    assert {row["name"] for row in data["backends"]} >= {"cpu", "cuda", "npu"}


def test_python_dash_m_hyperpar_is_the_command():
    proc = hyperpar_cmd("info", "--check", env={"HYPERPAR_BACKEND": "nonsense"})
    assert proc.returncode == 1
    assert "Installed backends: cpu" in proc.stderr
