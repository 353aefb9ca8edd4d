"""No module in ``hyperpar/`` or ``backends/`` is over 600 lines (issue 54): a longer one is split
by job, its public names kept importable from where they were. Lines are counted as ``wc -l``
would on the file as committed (``str.splitlines``), blank lines and docstrings included.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
#: Folders whose modules are counted.
FOLDERS = (ROOT / "hyperpar", ROOT / "backends")


def _modules() -> list[Path]:
    skip = {"__pycache__", "build", "dist"}
    return sorted(p for folder in FOLDERS for p in folder.rglob("*.py")
                  if not any(part in skip or part.endswith(".egg-info")
                             for part in p.relative_to(ROOT).parts))


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _too_long(paths: list[Path], limit: int = MAX_LINES) -> dict[str, int]:
    """``{module: lines}`` of the modules in ``paths`` over ``limit`` lines."""
    out = {}
    for path in paths:
        n = _lines(path)
        if n > limit:
            out[path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)] = n
    return out


def test_the_count_finds_a_long_module(tmp_path: Path) -> None:
    """The check itself: 601 lines is too long, 600 (with a final newline or without) is not."""
    long, fits, bare = tmp_path / "long.py", tmp_path / "fits.py", tmp_path / "bare.py"
    long.write_text("x = 1\n" * 601)
    fits.write_text("x = 1\n" * 600)
    bare.write_text("x = 1\n" * 599 + "x = 1")
    assert _too_long([long, fits, bare]) == {str(long): 601}


def test_no_module_over_600_lines() -> None:
    modules = _modules()
    # the walk sees both trees, the backends' packages included
    names = {p.relative_to(ROOT).as_posix() for p in modules}
    assert "hyperpar/dtensor/mesh.py" in names
    assert "backends/hyperpar-mindspore/hyperpar_mindspore/platform.py" in names
    long = _too_long(modules)
    assert not long, (f"modules over {MAX_LINES} lines (split them by job, keeping their public "
                      f"names importable from where they are): {long}")
