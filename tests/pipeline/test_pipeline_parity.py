"""Every schedule on 2 and 4 real ranks equals the whole model in one process (loss and
parameter gradients, tied embedding/head included) for several microbatch counts."""

from __future__ import annotations

import pytest
from pipeline_models import run_cases

CASES_2 = [
    # m < p, m not a multiple of p, m a multiple of p; several partitions
    *({"schedule": s, "m": m, "partition": part}
      for s in ("gpipe", "1f1b", "zerobubble")
      for m, part in ((1, "uniform"), (3, "parameters"), (4, [0, 4, 10]))),
    {"schedule": "1f1b", "m": 3, "checkpoint": 2, "partition": "type:block"},
    {"schedule": "zerobubble", "m": 4, "checkpoint": 2},
    {"schedule": "1f1b", "m": 2, "steps": 2},
    *({"schedule": "interleaved1f1b", "m": m, "virtual_stages": 2} for m in (1, 3, 4, 6)),
]

CASES_4 = [
    *({"schedule": s, "m": m, "partition": part}
      for s in ("gpipe", "1f1b", "zerobubble")
      for m, part in ((2, "uniform"), (5, [0, 4, 5, 8, 10]), (8, "parameters"))),
    {"schedule": "zerobubble", "m": 3, "checkpoint": 2},
    *({"schedule": "interleaved1f1b", "m": m, "virtual_stages": 2, "partition": "uniform"}
      for m in (2, 5, 8)),
]


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2ranks", "4ranks"])
def test_every_schedule_matches_single_process(run_on_ranks, world, cases):
    results = run_on_ranks(world, run_cases, cases, timeout_s=240)
    assert all(len(r) == len(cases) for r in results)
