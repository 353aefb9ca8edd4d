"""Layout planner: choose dp_replicate x dp_shard x tp x pp (or dp_replicate x dp_shard x cp),
microbatches and activation checkpointing for a model on N devices before renting them
(``hyperpar plan``).

Imports no framework: the model is described by its sizes (:func:`from_hf_config`), memory and
time are computed from formulas (:mod:`.memory`, :mod:`.timing`) and a device profile
(:mod:`.devices`). Only ``--measure`` (:mod:`.measure`) imports torch, when it runs.

>>> from hyperpar.plan import from_hf_config, Run, get_profile, plan   # doctest: +SKIP
>>> result = plan(from_hf_config("config.json"), Run(world=1024, seq_len=4096,
...               global_batch=1024), get_profile("h100"))
>>> result.ranked[0].layout.name                                       # doctest: +SKIP
"""

from .devices import PROFILES, DeviceProfile, get_profile, load_profile, save_profile
from .layout import Layout, Run
from .memory import Memory, memory_per_rank
from .model import ModelSpec, example_spec, from_hf_config
from .moe import MoESpec, moe_from_hf_config
from .report import frontier, plot, to_json
from .search import Candidate, PlanResult, RuledOut, plan, shape_problems
from .timing import StepTime, step_time

__all__ = [
    "PROFILES", "Candidate", "DeviceProfile", "Layout", "Memory", "MoESpec", "ModelSpec",
    "PlanResult", "moe_from_hf_config",
    "RuledOut", "Run", "StepTime", "example_spec", "from_hf_config", "frontier", "get_profile",
    "load_profile", "memory_per_rank", "plan", "plot", "save_profile", "shape_problems",
    "step_time", "to_json",
]
