"""Output of a plan: the ranked table, the ruled-out summary, the ``--json`` document and the
frontier plot (peak memory vs step time; matplotlib when installed, else a plain SVG)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from .layout import Layout
from .memory import Memory
from .search import Candidate, PlanResult, RuledOut
from .timing import StepTime

SCHEMA_VERSION = 2


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}B"


def table(result: PlanResult, top: int = 10) -> str:
    """The best ``top`` layouts, one line each (memory in GiB per rank)."""
    r = result.run
    head = (f"{result.spec.name}: {result.spec.parameters:,} parameters; world {r.world} "
            f"({r.gpus_per_node}/node) on {result.profile.name}; seq {r.seq_len}, global batch "
            f"{r.global_batch}, {r.param_dtype}, {r.optimizer}; {result.considered} layouts, "
            f"{len(result.ranked)} fit")
    cols = ("rank", "layout", "params", "grads", "optim", "buffers", "activ", "peak",
            "step ms", "tok/s/dev", "comm/rank/step tp|fsdp|dp|pp|cp")
    rows = []
    for i, c in enumerate(result.ranked[:top], 1):
        m, cb = c.memory, c.time.comm_bytes
        rows.append((str(i), c.layout.name, _gib(m.params), _gib(m.grads), _gib(m.optimizer),
                     _gib(m.fsdp_buffers), _gib(m.activations), _gib(m.peak),
                     f"{c.time.step_ms:.1f}", f"{c.tokens_per_s_per_device:,.0f}",
                     "|".join(_bytes(cb.get(d, 0.0)) for d in
                              ("tp", "dp_shard", "dp_replicate", "pp", "cp"))))
        if c.measured:
            rows.append(("", "  measured", "", "", "", "", "",
                         _gib(c.measured.get("peak", 0)) if c.measured.get("peak") else "-",
                         f"{c.measured['step_ms']:.1f}" if "step_ms" in c.measured else "-",
                         "", ""))
    widths = [max(len(x) for x in col) for col in zip(cols, *rows, strict=False)]
    lines = [head, "memory per rank in GiB", "  ".join(c.ljust(w) for c, w in zip(
        cols, widths, strict=True))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in rows]
    if not result.ranked:
        lines.append("no layout fits; see the reasons below")
    return "\n".join(lines)


def ruled_out_summary(result: PlanResult, examples: int = 3) -> str:
    """How many layouts were ruled out for each kind of reason, with a few examples; the
    out-of-memory ones closest to fitting first."""
    if not result.ruled_out:
        return "no layout ruled out"
    lines = [f"{len(result.ruled_out)} layouts ruled out:"]
    oom = [x for x in result.ruled_out if x.kind == "oom"]
    if oom:
        def over(x: Any) -> float:
            return float(x.reason.split("OOM by ")[1].split(" GiB")[0])
        oom.sort(key=over)
        lines.append(f"  out of memory: {len(oom)} (closest to fitting first)")
        lines += [f"    {x.layout.name}: {x.reason}" for x in oom[:examples]]
    shape = [x for x in result.ruled_out if x.kind == "divisibility"]
    if shape:
        counts = Counter(p.split(" ")[0].split("=")[0] for x in shape for p in x.reason.split("; "))
        lines.append(f"  dims that do not divide: {len(shape)} "
                     f"({', '.join(f'{k}: {v}' for k, v in counts.most_common())})")
        lines += [f"    {x.layout.name}: {x.reason}" for x in shape[:examples]]
    return "\n".join(lines)


def _dims_json(lay: Layout) -> dict[str, Any]:
    return {"name": lay.name, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
            "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": 1, "etp": 1,  # dense: no experts
            "cp_shard": lay.cp_shard, "microbatches": lay.microbatches,
            "activation_checkpointing": lay.activation_checkpointing,
            "ac_every": lay.ac_every,
            "selective_ac": lay.selective_ac, "loss_parallel": lay.loss_parallel}


def time_json(t: StepTime) -> dict[str, float]:
    """The parts of a predicted step, in ms (they add up to more than ``step_ms`` where
    collectives overlap compute: only their exposed part is in the step)."""
    return {"compute_ms": t.compute_s * 1e3, "bubble_ms": t.bubble_s * 1e3,
            "tp_ms": t.tp_s * 1e3, "pp_ms": t.pp_s * 1e3,
            "fsdp_exposed_ms": t.fsdp_exposed_s * 1e3, "dp_exposed_ms": t.dp_exposed_s * 1e3,
            "optimizer_ms": t.optimizer_s * 1e3}


def layout_json(c: Candidate) -> dict[str, Any]:
    out: dict[str, Any] = {
        **_dims_json(c.layout), "memory": c.memory.to_json(),
        "predicted_step_ms": c.time.step_ms, "time": time_json(c.time),
    }
    if c.measured is not None:
        # the prediction the --measure table compares: this machine's calibrated profile, not
        # the shipped one of predicted_step_ms above
        out["measured"] = {key: c.measured.get(key) for key in (
            "peak", "step_ms", "predicted_peak", "predicted_step_ms")}
    return out


def ruled_out_json(x: RuledOut) -> dict[str, Any]:
    out: dict[str, Any] = {**_dims_json(x.layout), "kind": x.kind, "reason": x.reason}
    if x.memory is not None and x.time is not None:
        out.update(over_bytes=x.over_bytes, memory=x.memory.to_json(),
                   predicted_step_ms=x.time.step_ms, time=time_json(x.time))
    return out


def to_json(result: PlanResult) -> dict[str, Any]:
    """The ``--json`` document (schema in docs/planning.md): fitting layouts, best first, and
    the ruled-out ones with their reason (out-of-memory ones with their numbers)."""
    return {"schema_version": SCHEMA_VERSION, "parameters": result.spec.parameters,
            "device_memory": result.run.device_memory,
            "layouts": [layout_json(c) for c in result.ranked],
            "ruled_out": [ruled_out_json(x) for x in result.ruled_out]}


def write_json(result: PlanResult, path: str | Path) -> None:
    """Compact JSON: ``indent`` would route ``json.dumps`` through its pure-Python encoder,
    about 3x slower on the 11,793 layouts of a 16,384-device search (1.4 s against 0.4 s)."""
    Path(path).write_text(json.dumps(to_json(result), separators=(",", ":")) + "\n")


def _memory_lines(m: Memory) -> list[str]:
    g = 2**30
    held = "" if m.grads_at_peak else " (not live at the peak)"
    return [f"  memory per rank (stage {m.stage}, GiB): params {m.params / g:.2f}, grads "
            f"{m.grads / g:.2f}{held}, optimizer {m.optimizer / g:.2f}, fsdp buffers "
            f"(gathered units, unsharded gradients) "
            f"{m.fsdp_buffers / g:.2f}, activations {m.activations / g:.2f}; peak "
            f"{m.peak / g:.2f}"]


def describe_one(result: PlanResult, x: Candidate | RuledOut) -> str:
    """The breakdown of one given layout (``--layout``): memory and time, and whether it fits
    (by how much it does not)."""
    r = result.run
    lines = [f"{result.spec.name}: {result.spec.parameters:,} parameters; world {r.world} "
             f"({r.gpus_per_node}/node) on {result.profile.name}; seq {r.seq_len}, global "
             f"batch {r.global_batch}, {r.param_dtype}, {r.optimizer}; device memory "
             f"{r.device_memory / 2**30:.2f} GiB",
             f"layout {x.layout.name}:"]
    if isinstance(x, RuledOut):
        lines.append(f"  does not run: {x.reason}")
        if x.memory is None or x.time is None:
            return "\n".join(lines)
        mem, t = x.memory, x.time
    else:
        lines.append(f"  fits, {(r.device_memory - x.memory.peak) / 2**30:.2f} GiB to spare")
        mem, t = x.memory, x.time
    lines += _memory_lines(mem)
    parts = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in time_json(t).items())
    tok = r.global_batch * r.seq_len / t.step_s / r.world
    lines.append(f"  step {t.step_ms:.1f} ms ({tok:,.0f} tok/s/device"
                 f"{' if it had the memory' if isinstance(x, RuledOut) else ''}); parts (ms): "
                 f"{parts}")
    return "\n".join(lines)


def frontier(result: PlanResult) -> list[Candidate]:
    """Layouts no other layout beats on both step time and peak memory, fastest first."""
    best: list[Candidate] = []
    lowest = float("inf")
    for c in sorted(result.ranked, key=lambda c: (c.time.step_s, c.memory.peak)):
        if c.memory.peak < lowest:
            best.append(c)
            lowest = c.memory.peak
    return best


def plot(result: PlanResult, path: str | Path, *, force_svg: bool = False) -> Path:
    """Write the frontier plot (every fitting layout, frontier highlighted) and return the path
    written. matplotlib draws it when installed (the ``bench`` extra); otherwise, or with
    ``force_svg``, a built-in writer draws an SVG (a ``.png`` path then becomes ``.svg``)."""
    path = Path(path)
    pts = [(c.memory.peak / 2**30, c.time.step_ms) for c in result.ranked]
    front = frontier(result)
    fpts = [(c.memory.peak / 2**30, c.time.step_ms, c.layout.name) for c in front]
    title = (f"{result.spec.name} on {result.run.world} x {result.profile.name}: "
             f"{len(pts)} layouts fit")
    try:
        if force_svg:
            raise ImportError("built-in SVG writer requested")
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = path.with_suffix(".svg")
        _svg(path, pts, fpts, title, result.run.device_memory / 2**30)
        return path
    fig, ax = plt.subplots(figsize=(8, 5))
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, c="#9aa", label="fits")
        ax.plot([p[0] for p in fpts], [p[1] for p in fpts], "o-", c="#c33", label="frontier")
        # label the fastest few and the leanest: the ends of the trade-off
        for i, (x, y, name) in enumerate(fpts[:3] + fpts[-1:]):
            ax.annotate(name, (x, y), fontsize=7, xytext=(6, 10 + 12 * i),
                        textcoords="offset points", arrowprops={"arrowstyle": "-", "lw": 0.5})
        ax.set_yscale("log")
    ax.axvline(result.run.device_memory / 2**30, ls="--", c="k", lw=0.8, label="device memory")
    ax.set_xlabel("peak memory per rank (GiB)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _svg(path: Path, pts: list[tuple[float, float]], fpts: list[tuple[float, float, str]],
         title: str, limit: float) -> None:
    w, h, pad = 720, 450, 60
    xs = [p[0] for p in pts] + [limit]
    ys = [p[1] for p in pts] or [1.0]
    x0, x1 = 0.0, max(xs) * 1.05
    y0, y1 = 0.0, max(ys) * 1.05

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0 or 1) * (w - 2 * pad)

    def sy(y: float) -> float:
        return h - pad - (y - y0) / (y1 - y0 or 1) * (h - 2 * pad)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle">{_esc(title)}</text>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">peak memory per rank (GiB)'
           f'</text>',
           f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" '
           f'text-anchor="middle">predicted step time (ms)</text>']
    for i in range(5):
        xv, yv = x0 + (x1 - x0) * i / 4, y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{sx(xv):.1f}" y="{h - pad + 15}" text-anchor="middle">'
                   f'{xv:.1f}</text>')
        out.append(f'<text x="{pad - 5}" y="{sy(yv):.1f}" text-anchor="end">{yv:.0f}</text>')
    out.append(f'<line x1="{sx(limit):.1f}" y1="{pad}" x2="{sx(limit):.1f}" y2="{h - pad}" '
               f'stroke="black" stroke-dasharray="4"/>')
    out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="#9aa"/>' for x, y in pts]
    if fpts:
        line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y, _ in fpts)
        out.append(f'<polyline points="{line}" fill="none" stroke="#c33"/>')
        for x, y, name in fpts[:8]:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="#c33"/>')
            out.append(f'<text x="{sx(x) + 5:.1f}" y="{sy(y) - 5:.1f}" font-size="9">'
                       f'{_esc(name)}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
