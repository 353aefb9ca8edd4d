"""``hyperpar bench``: run the side-by-side benchmarks and write a report.

Benchmark script contract
-------------------------
A benchmark is a script ``benchmarks/bench_<name>.py`` that compares a hyperpar code path with
a reference (torch-native, raw collectives, ...) on the backend selected by
``HYPERPAR_BACKEND`` (the runner sets it). It starts any processes it needs itself (e.g. with
:func:`hyperpar.testing.run_distributed`) and must finish within the runner's timeout.

When run with ``--json PATH`` it writes to ``PATH`` a JSON list of rows::

    {"benchmark": "tp",                 # short name of the benchmark
     "case": "mlp 1024x4096, 2 ranks",  # what was measured
     "hyperpar_ms": 1.92,               # hyperpar time (ms, lower is better)
     "reference": "torch.distributed.tensor.parallel",
     "reference_ms": 1.85,              # reference time (ms), or null if none
     "ratio": 1.04}                     # hyperpar_ms / reference_ms (1.0 = parity), or null

and may print anything it likes to stdout/stderr. ``ratio`` is recomputed by the runner when
it is missing and both times are present. A script that does not accept ``--json`` (argparse
exits with status 2 naming the option) is run again without it, and its output is shown as raw
text in the report.

A script that declares a ``--ranks N`` option is given the number of ranks the host allows when
the backend runs one rank per device (``min(devices, 2)``; ``HYPERPAR_BENCH_RANKS`` overrides):
on a one-GPU host every benchmark runs at world size 1. On cpu the scripts keep their defaults.

The runner writes ``DIR/results.md`` (machine, then a Markdown table of every row, then raw
outputs), ``DIR/results.json`` (the machine and the rows) and ``DIR/ratios.png`` (a bar chart of
the ratios; skipped with a message when matplotlib is not installed). ``--update-doc FILE``
also replaces the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` in FILE with
the report and copies the plot next to FILE as ``<FILE stem>-ratios.png``.
"""

from __future__ import annotations

import json
import math
import os
import platform as _host
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Ranks a benchmark runs at when the host limits them (one rank per device): at most this many,
#: the scripts' common default. ``HYPERPAR_BENCH_RANKS`` overrides it.
DEFAULT_RANKS = 2
RANKS_ENV = "HYPERPAR_BENCH_RANKS"
ROW_KEYS = ("benchmark", "case", "hyperpar_ms", "reference", "reference_ms", "ratio")
DOC_BEGIN = "<!-- bench:begin -->"
DOC_END = "<!-- bench:end -->"
#: What ``hyperpar bench`` needs and an installed wheel lacks (the scripts import the repository's
#: ``examples`` package, so they run only from a checkout).
NEEDS_CHECKOUT = (
    "The benchmark scripts (benchmarks/bench_*.py, which import the repository's examples/) are "
    "not part of the installed package: run `hyperpar bench` from the root of a hyperpar "
    "repository checkout, or pass --dir CHECKOUT/benchmarks. Plots need "
    "`pip install 'hyperpar[bench]'` (numpy, matplotlib)."
)


@dataclass
class BenchRun:
    """One benchmark script's run: its rows (JSON contract) or its raw output."""

    name: str
    script: str
    returncode: int
    seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    output: str = ""
    json_supported: bool = True
    error: str = ""


# --------------------------------------------------------------------------- discovery
def default_bench_dir() -> Path:
    return Path.cwd() / "benchmarks"


def discover(bench_dir: Path) -> dict[str, Path]:
    """``{name: path}`` of every ``bench_<name>.py`` in ``bench_dir``, sorted by name."""
    return {p.stem[len("bench_"):]: p for p in sorted(bench_dir.glob("bench_*.py"))}


def select(found: dict[str, Path], names: list[str]) -> dict[str, Path]:
    """The benchmarks named (``tp`` or ``bench_tp`` or ``bench_tp.py``); all when none."""
    if not names:
        return found
    picked: dict[str, Path] = {}
    for raw in names:
        name = Path(raw).stem
        name = name[len("bench_"):] if name.startswith("bench_") else name
        if name not in found:
            raise ValueError(f"no benchmark named {raw!r}; available: "
                             f"{', '.join(found) or 'none'}")
        picked[name] = found[name]
    return picked


# --------------------------------------------------------------------------- running
def host_ranks() -> tuple[int | None, str]:
    """``(N, why)``: the ``--ranks N`` to give scripts that accept it, or ``None`` to keep their
    defaults. ``HYPERPAR_BENCH_RANKS`` wins; else, on a backend that runs one rank per device
    (cuda, npu), ``min(devices visible, DEFAULT_RANKS)`` -- from the platform's capacity check,
    so a one-GPU host runs every benchmark at world size 1 instead of failing to start."""
    forced = os.environ.get(RANKS_ENV, "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{RANKS_ENV}={forced!r}: expected a positive number of ranks")
        return int(forced), f"{RANKS_ENV}={forced}"
    from hyperpar.platform import get_platform

    platform = get_platform()
    limit = platform.max_local_ranks()
    if limit is None:
        return None, f"backend {platform.name}: ranks share the device (script defaults)"
    n = max(1, min(limit, DEFAULT_RANKS))
    return n, (f"backend {platform.name} runs one rank per device and {limit} "
               f"{platform.device_type} device(s) are visible")


def accepts_ranks(script: Path) -> bool:
    """Whether a benchmark script takes ``--ranks N`` (its argparse declares the option)."""
    try:
        return '"--ranks"' in script.read_text()
    except OSError:
        return False


def normalise_row(row: dict[str, Any], name: str) -> dict[str, Any]:
    """A contract row with every key present and ``ratio`` filled in when computable."""
    if not isinstance(row, dict):
        raise ValueError(f"bench_{name}: a row must be a JSON object, got {row!r}")
    out = {k: row.get(k) for k in ROW_KEYS}
    out["benchmark"] = out["benchmark"] or name
    for key in ("hyperpar_ms", "reference_ms", "ratio"):
        if out[key] is not None:
            out[key] = float(out[key])
    if out["ratio"] is None and out["hyperpar_ms"] is not None and out["reference_ms"]:
        out["ratio"] = out["hyperpar_ms"] / out["reference_ms"]
    return out


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        return -1, out + f"\n[hyperpar bench: timed out after {timeout_s:.0f} s]"
    return proc.returncode, proc.stdout


def run_one(name: str, script: Path, *, timeout_s: float = 600.0,
            env: dict[str, str] | None = None, args: list[str] | None = None) -> BenchRun:
    """Run one benchmark script by the contract above (``args``: extra script arguments)."""
    extra = list(args or [])
    env = dict(os.environ if env is None else env)
    cwd = script.resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="hyperpar-bench-") as tmp:
        path = Path(tmp) / "rows.json"
        start = time.perf_counter()
        code, output = _run([sys.executable, str(script), *extra, "--json", str(path)], env,
                            cwd, timeout_s)
        run = BenchRun(name, str(script), code, 0.0, output=output)
        if code == 2 and "--json" in output and not path.exists():
            # argparse rejected --json: an older script, shown as raw text.
            run.json_supported = False
            run.returncode, run.output = _run([sys.executable, str(script), *extra], env, cwd,
                                              timeout_s)
        elif path.exists():
            try:
                rows = json.loads(path.read_text())
                if not isinstance(rows, list):
                    raise ValueError(f"expected a JSON list of rows, got {type(rows).__name__}")
                run.rows = [normalise_row(r, name) for r in rows]
            except ValueError as exc:
                run.error = f"bad --json output: {exc}"
        else:
            run.json_supported = False
        run.seconds = time.perf_counter() - start
    if run.returncode != 0 and not run.error:
        run.error = f"exit status {run.returncode}"
    return run


# --------------------------------------------------------------------------- reporting
def machine() -> dict[str, Any]:
    """The machine and software the numbers came from."""
    from hyperpar.platform.info import collect_info

    info = collect_info()
    cpu = _host.processor() or _host.machine()
    try:
        with open("/proc/cpuinfo") as fp:
            for line in fp:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        load = None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": load,
        "host": info.host, "processor": cpu, "cpu_count": os.cpu_count(),
        "backend": info.selected or f"none ({info.selection_error})",
        "device_count": info.device_count,
        "hyperpar": info.hyperpar_version, "torch": info.torch_version,
        "python": info.python_version,
    }


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def results_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the rows (``ratio`` = hyperpar / reference, lower is better)."""
    lines = ["| benchmark | case | hyperpar (ms) | reference | reference (ms) | ratio |",
             "|---|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['benchmark']} | {r['case'] or ''} | {_fmt(r['hyperpar_ms'], '.3f')} "
                     f"| {r['reference'] or ''} | {_fmt(r['reference_ms'], '.3f')} "
                     f"| {_fmt(r['ratio'], '.2f')} |")
    return "\n".join(lines)


def _load_text(mach: dict[str, Any]) -> str:
    load = mach.get("load_average")
    if load is None:
        return ""
    busy = " -- a busy machine, numbers are indicative" if load > (mach["cpu_count"] or 1) else ""
    return f", load average {load:.2f} at the start{busy}"


def render_markdown(runs: list[BenchRun], mach: dict[str, Any], png: str | None) -> str:
    rows = [r for run in runs for r in run.rows]
    out = [
        "# hyperpar benchmark results", "",
        f"Measured {mach['date']} on {mach['host']}, {mach['processor']} ({mach['cpu_count']} "
        f"cores{_load_text(mach)}); backend **{mach['backend']}** ({mach['device_count']} "
        f"device(s)); hyperpar {mach['hyperpar']}, torch {mach['torch']}, "
        f"python {mach['python']}.", "",
        "`ratio` = hyperpar time / reference time: 1.00 is parity, below 1 hyperpar is faster.",
        "",
    ]
    if mach.get("ranks") is not None:
        out[-2:-2] = [f"Multi-rank benchmarks ran at {mach['ranks']} rank(s): "
                      f"{mach['ranks_reason']}.", ""]
    out.append(results_table(rows) if rows else "_No benchmark produced JSON rows._")
    if png:
        out += ["", f"![ratios]({png})"]
    failed = [run for run in runs if run.error]
    if failed:
        out += ["", "## Failures", ""]
        out += [f"- `{Path(run.script).name}`: {run.error}" for run in failed]
    raw = [run for run in runs if not run.rows and run.output.strip()]
    if raw:
        out += ["", "## Raw output", ""]
        for run in raw:
            out += [f"### {Path(run.script).name}", "", "```text", run.output.rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def _wrap_label(text: str, width: int = 48) -> str:
    return "\n".join(textwrap.wrap(text, width, break_long_words=False,
                                    break_on_hyphens=False)) or text


def plot_ratios(rows: list[dict[str, Any]], path: Path, title: str = "") -> str | None:
    """Bar chart of the ratios into ``path``; returns a message instead when impossible.

    Long case names are wrapped (not squeezing the bars), the x axis leaves room for the largest
    bar's value, and the figure is saved with a tight bounding box so the title, the axis label
    and every label stay inside the image."""
    data = [(_wrap_label(f"{r['benchmark']}: {r['case']}")
             + (f"\nvs {r['reference']}" if r["reference"] else ""), r["ratio"])
            for r in rows if r["ratio"] is not None and math.isfinite(r["ratio"])]
    if not data:
        return "no ratios to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'hyperpar[bench]'); skipped the PNG"
    labels, ratios = zip(*data, strict=True)
    lines = sum(label.count("\n") + 1 for label in labels)
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.22 * lines + 0.3 * len(data) + 1.2)))
    colors = ["tab:green" if x <= 1.0 else "tab:orange" for x in ratios]
    bars = ax.barh(range(len(data)), ratios, color=colors)
    ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    ax.set_yticks(range(len(data)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlim(0, max(1.0, *ratios) * 1.15)  # room for the largest bar's value
    ax.set_xlabel("hyperpar time / reference time\n(lower is better, 1 = parity)")
    if title:
        ax.set_title(_wrap_label(title, 70), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return None


def update_doc(doc: Path, body: str) -> None:
    """Replace the block between the bench markers in ``doc`` with ``body``."""
    text = doc.read_text()
    if DOC_BEGIN not in text or DOC_END not in text:
        raise ValueError(f"{doc} has no '{DOC_BEGIN}' ... '{DOC_END}' block to update")
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    doc.write_text(f"{head}{DOC_BEGIN}\n{body.rstrip()}\n{DOC_END}{tail}")


def refresh_doc(doc: Path, markdown: str, png: Path | None) -> None:
    """Put a report into ``doc``'s bench block: the report without its title, and the plot
    copied next to the doc as ``<doc stem>-ratios.png`` (its link dropped when there is none)."""
    body = markdown.split("\n", 2)[2]
    # One heading level down: the block sits under a "##" section of the doc.
    body = body.replace("\n### ", "\n#### ").replace("\n## ", "\n### ")
    if png is not None and png.exists():
        target = doc.with_name(f"{doc.stem}-ratios.png")
        target.write_bytes(png.read_bytes())
        body = body.replace("![ratios](ratios.png)", f"![ratios]({target.name})")
    else:
        body = body.replace("\n![ratios](ratios.png)\n", "\n")
    update_doc(doc, body)


# --------------------------------------------------------------------------- entry point
def main(names: list[str] | None = None, out_dir: str = "bench-results",
         bench_dir: str | None = None, timeout_s: float = 600.0, list_only: bool = False,
         update_doc_path: str | None = None) -> int:
    """What ``hyperpar bench`` does; returns the exit status (1 if any benchmark failed)."""
    folder = Path(bench_dir) if bench_dir else default_bench_dir()
    if not folder.is_dir():
        print(f"hyperpar bench: error: no benchmarks folder at {folder}. {NEEDS_CHECKOUT}",
              file=sys.stderr)
        return 2
    found = discover(folder)
    try:
        picked = select(found, list(names or []))
    except ValueError as exc:
        print(f"hyperpar bench: error: {exc}", file=sys.stderr)
        return 2
    if list_only:
        for name, path in found.items():
            print(f"{name:<16} {path}")
        return 0
    if not picked:
        print(f"hyperpar bench: error: no bench_*.py scripts in {folder}", file=sys.stderr)
        return 2

    mach = machine()
    try:
        ranks, why = host_ranks()
    except ValueError as exc:
        print(f"hyperpar bench: error: {exc}", file=sys.stderr)
        return 2
    mach["ranks"] = ranks
    mach["ranks_reason"] = why
    env = dict(os.environ)
    if not mach["backend"].startswith("none"):
        env["HYPERPAR_BACKEND"] = mach["backend"]
    runs: list[BenchRun] = []
    for name, path in picked.items():
        args = ["--ranks", str(ranks)] if ranks is not None and accepts_ranks(path) else []
        shown = f" with {' '.join(args)}" if args else ""
        print(f"hyperpar bench: {name} ({path}) on {mach['backend']}{shown} ...", flush=True)
        run = run_one(name, path, timeout_s=timeout_s, env=env, args=args)
        runs.append(run)
        if run.output.strip():
            print(run.output.rstrip())
        state = run.error or (f"{len(run.rows)} row(s)" if run.rows else "raw output")
        print(f"hyperpar bench: {name}: {state} in {run.seconds:.1f} s", flush=True)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for run in runs for r in run.rows]
    message = plot_ratios(rows, out / "ratios.png",
                          title=f"backend {mach['backend']}, {mach['processor']}, {mach['date']}")
    if message:
        print(f"hyperpar bench: {message}")
    markdown = render_markdown(runs, mach, None if message else "ratios.png")
    (out / "results.md").write_text(markdown)
    (out / "results.json").write_text(json.dumps(
        {"machine": mach, "rows": rows, "runs": [asdict(r) for r in runs]}, indent=2))
    print()
    print(results_table(rows) if rows else "(no JSON rows)")
    print(f"\nhyperpar bench: wrote {out / 'results.md'}"
          + ("" if message else f" and {out / 'ratios.png'}"))
    if update_doc_path:
        try:
            refresh_doc(Path(update_doc_path), markdown, None if message else out / "ratios.png")
        except (OSError, ValueError) as exc:
            print(f"hyperpar bench: error: {exc}", file=sys.stderr)
            return 2
        print(f"hyperpar bench: updated {update_doc_path}")
    return 1 if any(run.error for run in runs) else 0
