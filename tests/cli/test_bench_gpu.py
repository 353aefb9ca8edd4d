"""`hyperpar bench` on hosts that limit ranks (one per device), and a plot that fits its labels."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from hyperpar import bench
from hyperpar.platform import get_platform

RANKS_SCRIPT = """
import argparse, json
parser = argparse.ArgumentParser()
parser.add_argument("--ranks", type=int, default=2)
parser.add_argument("--json")
args = parser.parse_args()
with open(args.json, "w") as fp:
    json.dump([{"benchmark": "multi", "case": f"ran at {args.ranks} ranks",
                "hyperpar_ms": 1.0, "reference": "torch", "reference_ms": 1.0}], fp)
"""

NO_RANKS_SCRIPT = """
import argparse, json
parser = argparse.ArgumentParser()
parser.add_argument("--json")
args = parser.parse_args()
with open(args.json, "w") as fp:
    json.dump([{"benchmark": "single", "case": "world size 1", "hyperpar_ms": 1.0}], fp)
"""


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "bench_multi.py").write_text(textwrap.dedent(RANKS_SCRIPT))
    (folder / "bench_single.py").write_text(textwrap.dedent(NO_RANKS_SCRIPT))
    return folder


def _cases(out: Path) -> dict[str, str]:
    rows = json.loads((out / "results.json").read_text())["rows"]
    return {r["benchmark"]: r["case"] for r in rows}


def test_one_device_host_runs_multi_rank_benchmarks_at_world_size_1(bench_dir, tmp_path,
                                                                    monkeypatch):
    # The cpu platform made to report what a one-GPU cuda host reports: one rank per device.
    monkeypatch.delenv(bench.RANKS_ENV, raising=False)
    monkeypatch.setattr(get_platform(), "max_local_ranks", lambda: 1)
    out = tmp_path / "out"
    assert bench.main([], out_dir=str(out), bench_dir=str(bench_dir)) == 0
    assert _cases(out) == {"multi": "ran at 1 ranks", "single": "world size 1"}
    assert "Multi-rank benchmarks ran at 1 rank(s): backend cpu runs one rank per device" in (
        out / "results.md").read_text()


def test_ranks_shared_device_keeps_script_defaults(bench_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(bench.RANKS_ENV, raising=False)
    out = tmp_path / "out"
    assert bench.main(["multi"], out_dir=str(out), bench_dir=str(bench_dir)) == 0
    assert _cases(out) == {"multi": "ran at 2 ranks"}


def test_bench_ranks_env_overrides_and_bad_value_is_refused(bench_dir, tmp_path, monkeypatch,
                                                            capsys):
    out = tmp_path / "out"
    monkeypatch.setenv(bench.RANKS_ENV, "4")
    assert bench.main(["multi"], out_dir=str(out), bench_dir=str(bench_dir)) == 0
    assert _cases(out) == {"multi": "ran at 4 ranks"}
    monkeypatch.setenv(bench.RANKS_ENV, "two")
    assert bench.main(["multi"], out_dir=str(out), bench_dir=str(bench_dir)) == 2
    assert "HYPERPAR_BENCH_RANKS='two': expected a positive number of ranks" in (
        capsys.readouterr().err)


def test_ratio_plot_keeps_title_axis_label_and_values_inside_the_image(tmp_path):
    """Long case names, a long title and a bar well above 1: nothing may touch the image's
    edges (before, the title, the axis label and the largest value were cut at the right)."""
    image = pytest.importorskip("matplotlib.image")
    rows = [bench.normalise_row({"benchmark": "llama", "case": "compiled step (inductor, 0 "
                                 "breaks), dim 2048 x 8 layers, batch 4 x 1024, bfloat16, "
                                 "world size 1; peak 20.10 GiB vs 20.05 GiB",
                                 "hyperpar_ms": 62.4, "reference": "plain (compiled)",
                                 "reference_ms": 27.3}, "llama"),
            bench.normalise_row({"benchmark": "tp", "case": "small", "hyperpar_ms": 1.0,
                                 "reference": "torch-native TP", "reference_ms": 2.0}, "tp")]
    path = tmp_path / "ratios.png"
    title = "backend cuda, NVIDIA H100 80GB HBM3, Intel(R) Xeon(R) Platinum, 2026-11-22 23:59 UTC"
    assert bench.plot_ratios(rows, path, title=title) is None
    pixels = image.imread(str(path))[..., :3]
    border = [pixels[:, -3:], pixels[:, :3], pixels[:3, :], pixels[-3:, :]]
    assert all(edge.min() > 0.99 for edge in border), "something is drawn at the image edge"
