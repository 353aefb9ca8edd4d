"""Probes: ask a collective library for a known answer before trusting one of its ops.

Some torch releases give wrong values for a collective without raising: torch 2.6's gloo
``reduce_scatter`` with MAX, MIN or PRODUCT returns the SUM. A version table would have to
guess which builds carry such a bug; a probe measures it. :func:`reduce_scatter_verdicts` runs a
two-rank reduce-scatter of each non-sum op on a private gloo pair inside this process (two
threads, an in-memory store, no launcher, no process group of the caller's touched) and records
which ops answered correctly. :class:`~hyperpar.platform.torch_platform.TorchPlatform` composes
the ops that did not (all-reduce, then keep the local slice) and lists them in
``collective_fallbacks()``, so ``hyperpar info`` shows them.

gloo is probed that way (it runs on any host, so ``hyperpar info`` can show the verdict before
any process group exists). Another library (NCCL, HCCL, ...) is probed on the caller's own
group, the first time a process reduce-scatters with one of those ops on a group of two or more
ranks: every member is making that same call, so a tiny reduce-scatter with known inputs plus a
sum all-reduce of the verdict keeps the ranks in step and in agreement
(:func:`probe_on_group`). Until an op is measured, a compiled region composes it.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

PROBED_OPS = ("max", "min", "product")
_WORLD = 2
# torch 2.13 renamed reduce_scatter_tensor (see torch_platform.py)
_reduce_scatter_single = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
_TIMEOUT = timedelta(seconds=30)

# dist backend -> {op: the native reduce-scatter gave the right values}; a probe that could not
# run maps every op to False (compose: correct whatever the library does).
_VERDICTS: dict[str, dict[str, bool]] = {}
_ERRORS: dict[str, str] = {}


def _expected(op: str, world: int) -> float:
    """Rank r contributes ``r + 2`` everywhere: sum, max, min and product all differ."""
    values = [float(r + 2) for r in range(world)]
    if op == "max":
        return max(values)
    if op == "min":
        return min(values)
    product = 1.0
    for v in values:
        product *= v
    return product


def _gloo_pair_results() -> list[dict[str, float]]:
    torch_ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                 "product": dist.ReduceOp.PRODUCT}
    store = dist.HashStore()
    results: list[dict[str, float] | None] = [None] * _WORLD
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, _WORLD, _TIMEOUT)
            got = {}
            for op in PROBED_OPS:
                opts = dist.ReduceScatterOptions()
                opts.reduceOp = torch_ops[op]
                out = torch.zeros(1)
                group._reduce_scatter_base(out, torch.full((_WORLD,), float(rank + 2)),
                                           opts).wait()
                got[op] = out.item()
            results[rank] = got
        except BaseException as exc:  # reported by the caller, never raised in a thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True)
               for r in range(_WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_TIMEOUT.total_seconds() + 5)
    if errors:
        raise errors[0]
    if any(r is None for r in results):
        raise TimeoutError("the two-thread gloo probe did not finish")
    return results  # type: ignore[return-value]


def reduce_scatter_verdicts(dist_backend: str) -> dict[str, bool] | None:
    """``{op: native reduce-scatter correct}`` for ``max``/``min``/``product`` on
    ``dist_backend``, measured once per process; ``None`` for a library that is not probed."""
    if dist_backend in _VERDICTS:
        return _VERDICTS[dist_backend]
    if dist_backend != "gloo" or not dist.is_available():
        return None
    try:
        results = _gloo_pair_results()
    except Exception as exc:  # no probe, no trust: the composition is correct either way
        _ERRORS[dist_backend] = f"{exc.__class__.__name__}: {exc}"
        verdicts = dict.fromkeys(PROBED_OPS, False)
    else:
        verdicts = {op: all(r[op] == _expected(op, _WORLD) for r in results)
                    for op in PROBED_OPS}
    _VERDICTS[dist_backend] = verdicts
    return verdicts


def probe_on_group(dist_backend: str, op: str, group: object, device: torch.device) -> bool:
    """Measure ``op``'s native reduce-scatter on ``group`` (every member must be calling this,
    as they do inside one reduce-scatter), record and return the verdict."""
    verdicts = _VERDICTS.setdefault(dist_backend, {})
    if op in verdicts:
        return verdicts[op]
    n, r = dist.get_world_size(group), dist.get_rank(group)
    torch_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                "product": dist.ReduceOp.PRODUCT}[op]
    out = torch.zeros(1, device=device)
    _reduce_scatter_single(out, torch.full((n,), float(r + 2), device=device), torch_op,
                           group=group)
    bad = torch.tensor([0.0 if out.item() == _expected(op, n) else 1.0], device=device)
    dist.all_reduce(bad, dist.ReduceOp.SUM, group=group)  # one verdict for every member
    verdicts[op] = bad.item() == 0.0
    return verdicts[op]


def known_good(dist_backend: str, op: str) -> bool:
    """True when ``op``'s native reduce-scatter may be used: not a probed op, or measured
    correct. Reads only what was measured (safe inside a compiled region, where a probe cannot
    run: an op not yet measured there counts as not good, and is composed)."""
    if op not in PROBED_OPS:
        return True
    return _VERDICTS.get(dist_backend, {}).get(op, False)


def reduce_scatter_fallbacks(dist_backend: str) -> dict[str, str]:
    """What ``collective_fallbacks()`` reports for the ops a probe found wrong (so far, for a
    library probed on the caller's groups)."""
    verdicts = reduce_scatter_verdicts(dist_backend) or _VERDICTS.get(dist_backend)
    if not verdicts:
        return {}
    why = _ERRORS.get(dist_backend)
    reason = (f"the probe could not run ({why})" if why else
              f"a probe found {dist_backend}'s native reduce-scatter returns wrong values "
              f"(torch {torch.__version__})")
    return {f"reduce_scatter op {op!r}": f"all_reduce + local slice: {reason}"
            for op, ok in verdicts.items() if not ok}
