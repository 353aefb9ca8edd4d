"""Device profiles: what the time model needs to know about a device and its links.

The shipped profiles are **datasheet peaks times an assumed efficiency**, not measurements:
dense bf16/fp16 tensor-core FLOP/s, HBM bandwidth and link bandwidths as the vendors publish
them, with ``compute_efficiency`` (fraction of peak FLOP/s a well-tuned transformer step
reaches) and ``link_efficiency`` (fraction of link bandwidth a ring collective reaches) assumed.
Give a measured profile with ``--profile FILE`` (JSON with the same keys); ``hyperpar bench
--write-profile FILE`` measures one on this machine (:mod:`.calibrate`).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

#: Fixed costs paid over a group of ranks, by the mesh dim whose size keys them
#: (:meth:`DeviceProfile.fixed_cost`).
GROUP_COSTS = {"tp_layer_overhead_s": "tp", "tp_root_overhead_s": "tp",
               "fsdp_unit_overhead_s": "dp_shard", "pp_action_overhead_s": "pp",
               "dp_overhead_s": "dp_replicate", "cp_layer_overhead_s": "cp"}

GB = 1e9
MIB = 2**20  # device memory as the driver reports it (e.g. nvidia-smi's 81559 MiB for H100)


@dataclass(frozen=True)
class DeviceProfile:
    """Peak figures of one device and its links (bytes/s per direction per device).

    ``intra_*`` describe links inside a node (NVLink, HCCS, shared memory), ``inter_*`` the
    network between nodes, per device. ``alpha`` is the fixed latency of one ring step.

    The fixed costs below are 0 in the datasheet profiles (negligible next to a large model's
    FLOPs on an accelerator) and measured by ``hyperpar bench --write-profile`` /
    ``hyperpar plan --calibrate``, where they dominate (small models, a cpu):

    * ``layer_overhead_s``: one decoder layer's forward + backward beyond its FLOPs (op
      launches, autograd, Python);
    * ``root_overhead_s``: the embedding, final norm, head and loss, forward + backward, per
      microbatch;
    * ``tp_layer_overhead_s``: what tensor parallelism adds to one layer per microbatch beyond
      its collectives (DTensor dispatch, redistributions); ``tp_root_overhead_s`` the same for
      the embedding, head and loss;
    * ``fsdp_unit_overhead_s``: what one fully_shard unit adds per microbatch beyond its
      collectives (hooks, copies into and out of the flat buffers);
    * ``dp_overhead_s``: what ``data_parallel`` adds to a step beyond its all-reduce (gradient
      hooks, copies into and out of the buckets);
    * ``cp_layer_overhead_s``: what context parallelism adds to one layer per microbatch
      beyond its collectives' own cost (the gathers' autograd, the mask, the ranks waiting on
      each other at each of the layer's blocking K/V collectives);
    * ``pp_action_overhead_s``: one pipeline action (a stage's forward or backward of one
      microbatch) beyond its compute: the executor and the message's fixed cost;
    * ``optimizer_tensor_overhead_s``: the optimizer step and ``zero_grad`` per local
      parameter tensor (``sharded_``: per DTensor parameter, fully_shard or tensor parallel);
    * ``collective_latency_s``: the fixed cost of one collective by group size (``{"2": s}``),
      measured; where given it replaces the ring's ``(n - 1) * alpha``;
    * ``matmul_flops_by_size``: FLOP/s of an ``n x n x n`` matmul by ``n`` (``{"32": f}``),
      measured; small matmuls run far below the peak, so where given the compute of a model
      runs at the rate of a matmul doing its per-rank projection's work per call
      (:meth:`flops_at`, :func:`hyperpar.plan.timing.matmul_size`);
    * ``comm_overlap``: the fraction of fully_shard / data-parallel communication that can hide
      behind compute (1 on accelerators with their own copy engines; 0 on a cpu, where gloo and
      the compute share the cores);
    * ``cores``: CPU cores the processes of one node share (0: every rank has a device of its
      own). Where a node runs more processes than cores, the fixed costs above are measured
      with every process busy; in a pipeline's ramp-up and ramp-down slots half of the ranks
      wait (asleep in a receive), and the busy ones run on the freed cores.

    The six group fixed costs (:data:`GROUP_COSTS`: ``tp_layer_overhead_s``,
    ``tp_root_overhead_s``, ``fsdp_unit_overhead_s``, ``pp_action_overhead_s``,
    ``dp_overhead_s``, ``cp_layer_overhead_s``) are paid over a group of ranks (the layout's
    tp, pp, dp_shard, dp_replicate or cp dim) and grow with its size where processes share
    cores. Each is either one number (every group size; what older profiles hold) or a table by
    group size like
    ``collective_latency_s`` (``{"2": s, "4": s}``), looked up by :meth:`fixed_cost`."""

    name: str
    flops_bf16: float          # peak dense FLOP/s in bf16/fp16
    flops_fp32: float          # peak dense FLOP/s in fp32 (no TF32)
    memory_bytes: int          # device memory
    hbm_bytes_per_s: float     # memory bandwidth (optimizer step is memory-bound)
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    intra_alpha_s: float = 5e-6
    inter_alpha_s: float = 15e-6
    compute_efficiency: float = 0.45
    link_efficiency: float = 0.7
    layer_overhead_s: float = 0.0
    root_overhead_s: float = 0.0
    tp_layer_overhead_s: float | dict[str, float] = field(default=0.0, hash=False)
    tp_root_overhead_s: float | dict[str, float] = field(default=0.0, hash=False)
    fsdp_unit_overhead_s: float | dict[str, float] = field(default=0.0, hash=False)
    pp_action_overhead_s: float | dict[str, float] = field(default=0.0, hash=False)
    dp_overhead_s: float | dict[str, float] = field(default=0.0, hash=False)
    cp_layer_overhead_s: float | dict[str, float] = field(default=0.0, hash=False)
    optimizer_tensor_overhead_s: float = 0.0
    sharded_optimizer_tensor_overhead_s: float = 0.0
    collective_latency_s: dict[str, float] = field(default_factory=dict, hash=False)
    matmul_flops_by_size: dict[str, float] = field(default_factory=dict, hash=False)
    comm_overlap: float = 1.0
    cores: float = 0
    #: price the non-matmul ops (norms, activations, dropout, softmax, residuals) as HBM
    #: traffic (:func:`hyperpar.plan.timing.elementwise_seconds`); off for calibrated
    #: profiles, whose ``layer_overhead_s`` measures them
    elementwise_hbm: bool = False
    source: str = "datasheet"

    def latency(self, n: int) -> float | None:
        """Measured fixed cost of one collective over ``n`` ranks (``None``: not measured)."""
        value = self.collective_latency_s.get(str(n))
        return None if value is None else float(value)

    def fixed_cost(self, key: str, n: int) -> float:
        """The group fixed cost ``key`` (one of :data:`GROUP_COSTS`) for a group of ``n`` ranks.

        A number applies to every group size. A table by group size gives the entry for ``n``
        where it was measured, else that of the nearest measured size on a log scale (a tie
        goes to the larger group, the dearer one): ``{"2": a, "4": b}`` gives ``a`` for 1 and 2,
        ``b`` for 3, 4 and 8. No rescaling is applied: nothing measured says how such a cost
        grows beyond the sizes measured."""
        value = getattr(self, key)
        if not isinstance(value, dict):
            return float(value)
        if not value:
            return 0.0
        if str(n) in value:
            return float(value[str(n)])
        target = math.log2(max(n, 1))
        best = min((int(k) for k in value),
                   key=lambda k: (round(abs(math.log2(k) - target), 9), -k))
        return float(value[str(best)])

    def flops(self, dtype: str) -> float:
        """Achievable FLOP/s for matmuls in ``dtype`` (peak x efficiency)."""
        peak = self.flops_fp32 if dtype == "float32" else self.flops_bf16
        return peak * self.compute_efficiency

    def flops_at(self, dtype: str, n: float) -> float:
        """Achievable FLOP/s for matmuls doing as much work per call as an ``n x n x n`` one:
        the measured rates interpolated on a log scale between the measured sizes (clamped to
        the smallest and largest), times ``compute_efficiency``; else :meth:`flops`."""
        if not self.matmul_flops_by_size:
            return self.flops(dtype)
        points = sorted((int(k), float(v)) for k, v in self.matmul_flops_by_size.items())
        if n <= points[0][0]:
            return points[0][1] * self.compute_efficiency
        if n >= points[-1][0]:
            return points[-1][1] * self.compute_efficiency
        for (lo, r_lo), (hi, r_hi) in zip(points, points[1:], strict=False):
            if lo <= n <= hi:
                share = math.log(n / lo) / math.log(hi / lo)
                return (r_lo + share * (r_hi - r_lo)) * self.compute_efficiency
        raise AssertionError("unreachable: n lies between the smallest and largest size")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


PROFILES: dict[str, DeviceProfile] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 67 TFLOP/s FP32, 80 GB HBM3 at
    # 3.35 TB/s, NVLink 900 GB/s (both directions), 400 Gb/s InfiniBand per GPU.
    "h100": DeviceProfile("NVIDIA H100 SXM 80GB", 989e12, 67e12, 81559 * MIB, 3.35e12,
                          450 * GB, 50 * GB, elementwise_hbm=True),
    # The H100 of Meta's Grand Teton hosts that torchtitan's published runs used (torchtitan
    # docs/performance.md): SXM, 96 GB HBM2e at 2.4 TB/s, 500 W power limit, whose peak the
    # page puts "between SXM and NVL": the H100 NVL datasheet's 835 TFLOP/s dense BF16 (1,671
    # with sparsity) and 60 TFLOP/s FP32, the lower bound; NVLink 900 GB/s, 400 Gb/s per GPU.
    "h100gt": DeviceProfile("NVIDIA H100 SXM 96GB HBM2e 500W (Grand Teton)", 835e12, 60e12,
                            96 * 10**9, 2.4e12, 450 * GB, 50 * GB, elementwise_hbm=True),
    # NVIDIA H800 SXM (the export H100 of DeepSeek-V3's cluster): H100's compute and HBM,
    # NVLink cut to 400 GB/s both directions (DeepSeek-V3 sec. 3.2.2: ~160 GB/s achieved),
    # one 400 Gb/s InfiniBand NIC per GPU (~50 GB/s).
    "h800": DeviceProfile("NVIDIA H800 SXM 80GB", 989e12, 67e12, 81559 * MIB, 3.35e12,
                          200 * GB, 50 * GB, elementwise_hbm=True),
    # NVIDIA H200 SXM: same compute as H100, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    "h200": DeviceProfile("NVIDIA H200 SXM 141GB", 989e12, 67e12, 143771 * MIB, 4.8e12,
                          450 * GB, 50 * GB, elementwise_hbm=True),
    # NVIDIA A100 SXM 80GB: 312 TFLOP/s dense BF16, 19.5 TFLOP/s FP32, 2.039 TB/s,
    # matmuls at 60% of peak (the one A100 figure; with the elementwise ops priced as HBM
    # traffic it puts torchtitan's A100 FSDP runs and Megatron-LM 2021 Table 1 within 25%),
    # NVLink 600 GB/s (both directions), 200 Gb/s InfiniBand per GPU.
    "a100": DeviceProfile("NVIDIA A100 SXM 80GB", 312e12, 19.5e12, 81920 * MIB, 2.039e12,
                          300 * GB, 25 * GB, elementwise_hbm=True, compute_efficiency=0.6),
    # Huawei Ascend 910B: ~313 TFLOP/s FP16 as commonly published (variants range about
    # 280-376), 64 GB HBM2e at ~1.6 TB/s, HCCS ~196 GB/s per direction, 200 Gb/s RoCE.
    # FP32 is not in the sources we used: assumed a quarter of FP16.
    "910b": DeviceProfile("Huawei Ascend 910B 64GB", 313e12, 313e12 / 4, 65536 * MIB, 1.6e12,
                          196 * GB, 25 * GB, elementwise_hbm=True),
}


def with_topology(profile: DeviceProfile, *, gpus_per_node: int,
                  intra_bytes_per_s: float | None = None, nics_per_node: int | None = None,
                  nic_bytes_per_s: float | None = None) -> DeviceProfile:
    """``profile`` with its links replaced by a node's: ``intra_bytes_per_s`` per device inside
    a node; between nodes the node's ``nics_per_node`` NICs of ``nic_bytes_per_s`` each,
    shared by its ``gpus_per_node`` devices (every rank of a node runs its group's collective
    at the same time, so each gets ``nics x nic / gpus``). A NIC count without a NIC speed
    keeps the profile's per-device figure as one NIC's speed."""
    from dataclasses import replace

    changes: dict[str, float] = {}
    if intra_bytes_per_s is not None:
        changes["intra_bytes_per_s"] = intra_bytes_per_s
    if nics_per_node is not None or nic_bytes_per_s is not None:
        nics = nics_per_node if nics_per_node is not None else gpus_per_node
        nic = nic_bytes_per_s if nic_bytes_per_s is not None else profile.inter_bytes_per_s
        if nics < 1 or nic <= 0:
            raise ValueError(f"hyperpar plan: nics per node ({nics}) and NIC bandwidth ({nic}) "
                             "must be positive")
        changes["inter_bytes_per_s"] = nics * nic / gpus_per_node
    return replace(profile, **changes) if changes else profile


def get_profile(name: str) -> DeviceProfile:
    """A shipped profile by short name (``h100``, ``h100-gt``, ``h200``, ``a100``,
    ``910b``)."""
    key = name.lower().replace("ascend", "").replace("-", "").replace(" ", "")
    if key not in PROFILES:
        raise ValueError(f"hyperpar plan: unknown device {name!r}; shipped profiles: "
                         f"{sorted(PROFILES)} (or give a measured one with --profile FILE)")
    return PROFILES[key]


def load_profile(path: str | Path) -> DeviceProfile:
    """A profile from a JSON file holding :class:`DeviceProfile`'s keys."""
    data = json.loads(Path(path).read_text())
    names = {f.name for f in fields(DeviceProfile)}
    unknown = sorted(set(data) - names)
    required = {f.name for f in fields(DeviceProfile) if f.default is MISSING}
    missing = sorted(required - set(data))
    if unknown or missing:
        raise ValueError(f"hyperpar plan: profile {str(path)!r}: unknown keys {unknown}, "
                         f"missing keys {missing}; accepted keys: {sorted(names)}")
    for key, example in (("collective_latency_s", '{"2": 0.0002}'),
                         ("matmul_flops_by_size", '{"64": 2e10}')):
        table = data.get(key, {})
        if not isinstance(table, dict) or not all(
                str(k).isdigit() and isinstance(v, (int, float)) for k, v in table.items()):
            raise ValueError(f"hyperpar plan: profile {str(path)!r}: {key} must map sizes to "
                             f"numbers, e.g. {example}, got {table!r}")
    for key in GROUP_COSTS:
        value = data.get(key, 0.0)
        if isinstance(value, bool) or not (isinstance(value, (int, float)) or (
                isinstance(value, dict) and all(
                    str(k).isdigit() and int(k) >= 1 and isinstance(v, (int, float))
                    and not isinstance(v, bool) for k, v in value.items()))):
            raise ValueError(f"hyperpar plan: profile {str(path)!r}: {key} must be a number "
                             f"(seconds, every group size) or map group sizes to seconds, "
                             f'e.g. 0.001 or {{"2": 0.001, "4": 0.003}}, got {value!r}')
        if isinstance(value, dict):
            data[key] = {str(k): float(v) for k, v in value.items()}
    cores = data.get("cores", 0)
    if isinstance(cores, bool) or not isinstance(cores, (int, float)) or cores < 0:
        raise ValueError(f"hyperpar plan: profile {str(path)!r}: cores must be a number >= 0 "
                         f"(CPU cores a node's processes share; 0: a device per rank), got "
                         f"{cores!r}")
    return DeviceProfile(**data)


def save_profile(profile: DeviceProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=2) + "\n")
