"""`hyperpar bench`: discovery, the --json contract, raw-text scripts, the report files."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from hyperpar.bench import DOC_BEGIN, DOC_END
from hyperpar.cli import main

JSON_SCRIPT = """
import argparse, json, os
parser = argparse.ArgumentParser()
parser.add_argument("--json")
args = parser.parse_args()
rows = [
    {"benchmark": "fast", "case": "mlp on " + os.environ["HYPERPAR_BACKEND"],
     "hyperpar_ms": 2.0, "reference": "torch", "reference_ms": 4.0},
    {"benchmark": "fast", "case": "no reference", "hyperpar_ms": 1.0,
     "reference": None, "reference_ms": None, "ratio": None},
]
print("measuring...")
if args.json:
    with open(args.json, "w") as fp:
        json.dump(rows, fp)
"""

RAW_SCRIPT = """
import argparse
argparse.ArgumentParser().parse_args()
print("old style: 3.2 ms vs 3.0 ms")
"""


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "bench_fast.py").write_text(textwrap.dedent(JSON_SCRIPT))
    (folder / "bench_raw.py").write_text(textwrap.dedent(RAW_SCRIPT))
    return folder


def test_bench_writes_a_table_of_ratios_and_raw_outputs(bench_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--backend", "cpu", "--dir", str(bench_dir), "--out", str(out)]) == 0
    report = (out / "results.md").read_text()
    assert "backend **cpu**" in report
    assert "| fast | mlp on cpu | 2.000 | torch | 4.000 | 0.50 |" in report
    assert "| fast | no reference | 1.000 |  | – | – |" in report
    assert "### bench_raw.py" in report and "old style: 3.2 ms vs 3.0 ms" in report
    data = json.loads((out / "results.json").read_text())
    assert data["rows"][0]["ratio"] == 0.5
    assert "| fast | mlp on cpu |" in capsys.readouterr().out


def test_bench_plots_the_ratios(bench_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    main(["bench", "fast", "--dir", str(bench_dir), "--out", str(out)])
    assert (out / "ratios.png").read_bytes()[:4] == b"\x89PNG"
    assert "![ratios](ratios.png)" in (out / "results.md").read_text()


def test_bench_runs_only_the_named_benchmarks(bench_dir, tmp_path):
    out = tmp_path / "out"
    main(["bench", "bench_raw.py", "--dir", str(bench_dir), "--out", str(out)])
    report = (out / "results.md").read_text()
    assert "bench_raw.py" in report and "mlp on" not in report


def test_unknown_benchmark_name_lists_the_available_ones(bench_dir, capsys):
    assert main(["bench", "nope", "--dir", str(bench_dir)]) == 2
    assert "no benchmark named 'nope'; available: fast, raw" in capsys.readouterr().err


def test_failing_benchmark_fails_the_command_and_is_reported(bench_dir, tmp_path):
    (bench_dir / "bench_broken.py").write_text("raise SystemExit(3)\n")
    out = tmp_path / "out"
    assert main(["bench", "broken", "--dir", str(bench_dir), "--out", str(out)]) == 1
    assert "`bench_broken.py`: exit status 3" in (out / "results.md").read_text()


def test_update_doc_replaces_only_the_marked_block(bench_dir, tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Performance\n\nintro\n\n{DOC_BEGIN}\nold numbers\n{DOC_END}\n\noutro\n")
    main(["bench", "fast", "--dir", str(bench_dir), "--out", str(tmp_path / "out"),
          "--update-doc", str(doc)])
    text = doc.read_text()
    assert text.startswith("# Performance\n\nintro\n\n") and text.endswith("\n\noutro\n")
    assert "old numbers" not in text and "| fast | mlp on" in text
    if (tmp_path / "out" / "ratios.png").exists():  # with matplotlib: the plot goes along
        assert "![ratios](performance-ratios.png)" in text
        assert (tmp_path / "performance-ratios.png").exists()
