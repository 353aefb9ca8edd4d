"""One candidate parallel layout and the run it is planned for."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Schedule = Literal["1f1b", "gpipe", "interleaved1f1b", "zbh1"]
SCHEDULES = ("1f1b", "gpipe", "interleaved1f1b", "zbh1")
Optimizer = Literal["adamw", "sgd", "sgd-momentum"]
DType = Literal["bfloat16", "float32"]

#: Mesh dims from outermost to innermost (tp innermost, so it stays inside a node longest).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Run:
    """What is being trained and on what: independent of the layout."""

    world: int
    seq_len: int
    global_batch: int               # sequences per optimizer step
    param_dtype: DType = "bfloat16"  # compute dtype; masters and optimizer states are fp32
    optimizer: Optimizer = "adamw"
    gpus_per_node: int = 8
    device_memory: int = 80 * 2**30
    #: ``flash``: a fused kernel, no ``seq x seq`` scores kept; ``eager``: materialised
    #: attention, the softmax probabilities saved for backward
    attention: Literal["flash", "eager"] = "flash"
    #: dtype data parallelism reduces gradients in: the compute dtype (hyperpar's default) or
    #: fp32 (torchtitan's ``mixed_precision_reduce`` default)
    reduce_dtype: Literal["compute", "float32"] = "compute"
    #: the loss kernel: ``eager`` ``F.cross_entropy(logits.float())`` (fp32 log-softmax held,
    #: two fp32 gradients of the logits' size in backward); ``fused``: one kernel that keeps
    #: the compute-dtype logits and a per-token log-sum-exp, its gradient in the logits' dtype
    #: (flash-attn's ``CrossEntropyLoss``, llm-foundry's ``fused_crossentropy`` default)
    #: ``torch-lp``: eager, with tp's loss parallel done by torch.distributed.tensor.parallel's
    #: ``loss_parallel`` (torchtitan), whose backward holds 16 bytes per logit shard
    loss: Literal["eager", "fused", "torch-lp"] = "eager"
    #: Float8 linears (torchtitan's ``float8`` converter, DeepSeek-V3's FP8 GEMMs): the
    #: matmuls' FLOP/s times this factor; 1 is bf16, 2 the H100 datasheet's FP8 / BF16 peak
    #: ratio (1,979 / 989 TFLOP/s), the ceiling. Attention and elementwise ops unchanged. A
    #: factor the user sets from what the run reaches, not a per-run constant of the planner
    float8: float = 1.0
    #: torch.compile's fusion of the elementwise ops: their HBM passes
    #: (:data:`hyperpar.plan.timing.ELEMENTWISE_PASSES`) divided by this factor; 1 eager
    compile_fusion: float = 1.0
    #: dtype of the optimizer's states (AdamW's two moments); the fp32 masters stay fp32.
    #: ``bfloat16``: DeepSeek-V3 sec. 3.3.3 ("BF16 ... to track the first and second moments")
    optimizer_dtype: Literal["float32", "bfloat16"] = "float32"
    #: dtype ZeRO-1/2 keep the (whole or partitioned) gradients in: the compute dtype
    #: (hyperpar's ZeRO) or fp32 (Megatron-core's fp32 main-grad buffer under bf16; DeepSeek-V3
    #: sec. 3.3.3: "gradients (used for batch size accumulation) are still retained in FP32")
    zero_grad_dtype: Literal["compute", "float32"] = "compute"

    def __post_init__(self) -> None:
        if not 1 <= self.float8 <= 4 or self.compile_fusion < 1:
            raise ValueError(f"hyperpar plan: float8={self.float8}, compile_fusion="
                             f"{self.compile_fusion}: factors >= 1 (float8 at most 4)")
        for key in ("world", "seq_len", "global_batch", "gpus_per_node", "device_memory"):
            if getattr(self, key) < 1:
                raise ValueError(f"hyperpar plan: {key} must be >= 1, got {getattr(self, key)}")
        if self.param_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"hyperpar plan: param dtype {self.param_dtype!r}; accepted: "
                             "bfloat16, float32")
        if self.reduce_dtype not in ("compute", "float32"):
            raise ValueError(f"hyperpar plan: reduce dtype {self.reduce_dtype!r}; accepted: "
                             "compute, float32")
        if self.loss not in ("eager", "fused", "torch-lp"):
            raise ValueError(f"hyperpar plan: loss {self.loss!r}; accepted: eager, fused, "
                             "torch-lp")
        if self.optimizer_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"hyperpar plan: optimizer dtype {self.optimizer_dtype!r}; "
                             "accepted: float32, bfloat16")
        if self.zero_grad_dtype not in ("compute", "float32"):
            raise ValueError(f"hyperpar plan: ZeRO gradient dtype {self.zero_grad_dtype!r}; "
                             "accepted: compute, float32")
        if self.attention not in ("flash", "eager"):
            raise ValueError(f"hyperpar plan: attention {self.attention!r}; accepted: flash, "
                             "eager")
        if self.optimizer not in ("adamw", "sgd", "sgd-momentum"):
            raise ValueError(f"hyperpar plan: optimizer {self.optimizer!r}; accepted: adamw, "
                             "sgd, sgd-momentum")

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype (gathered params, activations, comms)."""
        return 2 if self.param_dtype == "bfloat16" else 4

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of a gradient reduction."""
        return 4 if self.reduce_dtype == "float32" else self.compute_bytes

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes per element of one optimizer state."""
        return 2 if self.optimizer_dtype == "bfloat16" else 4

    @property
    def zero_grad_bytes(self) -> int:
        """Bytes per element of ZeRO-1/2's gradients."""
        return 4 if self.zero_grad_dtype == "float32" else self.compute_bytes

    @property
    def optimizer_states(self) -> int:
        """fp32 states per parameter element."""
        return {"adamw": 2, "sgd-momentum": 1, "sgd": 0}[self.optimizer]


@dataclass(frozen=True)
class Layout:
    """``dp_replicate x dp_shard x tp x pp x cp`` ranks, ``microbatches`` per step per
    data-parallel rank, per-layer activation checkpointing on or off. Sequence parallelism is
    used whenever ``tp > 1`` (the torchtitan plan). ``cp`` splits each sequence over ranks
    (``hyperpar.parallel.context_parallel``: K/V all-gathered per layer, head-tail order) and
    its ranks average gradients as data-parallel ranks do: with ``dp_shard == 1`` by
    ``data_parallel`` over the flattened ``dp_replicate x cp`` group; with ``dp_shard > 1`` by
    ``fully_shard`` over the flattened ``dp_shard x cp`` group (torchtitan's ``dp_shard_cp``),
    which then also shards parameters, gradients and optimizer states ``dp_shard * cp`` ways
    (:attr:`fsdp_shard`; HSDP with ``dp_replicate > 1``). The search pairs ``cp > 1`` with
    ``dp_replicate`` and ``dp_shard`` (``tp = pp = 1``)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    microbatches: int = 1
    activation_checkpointing: bool = False
    #: with activation_checkpointing: every ``ac_every``-th layer is checkpointed (layers
    #: ``0, k, 2k, ...``, torchtitan's selective "layer" policy; 1: every layer)
    ac_every: int = 1
    #: torchtitan's selective "op" checkpointing instead: per layer the outputs of every other
    #: matmul (wq, wv, w1, w2) and of attention are saved, the rest recomputed
    selective_ac: bool = False
    schedule: Schedule = "1f1b"
    #: under tp, compute the loss on the vocabulary shards (``hyperpar.loss_parallel``)
    #: instead of all-gathering the logits: no rank holds full-vocabulary logits
    loss_parallel: bool = False
    #: model chunks per pipeline rank (``interleaved1f1b`` only; 1 otherwise)
    virtual_stages: int = 1
    #: fully_shard's ``reshard_after_forward``: False keeps every layer gathered from its
    #: forward to its backward (no second all-gather, the stage's layers held whole)
    reshard_after_forward: bool = True
    #: sequence parallelism with tp (the torchtitan plan); False: tp without it, norms and
    #: dropout-free elementwise work on the whole sequence, all-reduces instead of
    #: all-gather / reduce-scatter pairs
    sp: bool = True
    #: with sp: each column-parallel linear keeps its all-gathered input as the sequence shard
    #: and gathers it again in backward (``ColwiseParallel(reshard_input_after_forward=True)``,
    #: hyperpar's default, ``hyperpar.parallel.spec.RESHARD_INPUT_DEFAULT``); False keeps it
    #: gathered, as torch's ColwiseParallel does
    sp_reshard_input: bool = True
    #: when fully_shard reduce-scatters gradients under gradient accumulation or a pipeline:
    #: ``microbatch`` (hyperpar.pipeline's engine, plain accumulation: after every backward) or
    #: ``step`` (torch.distributed.pipelining and hyperpar.pipelining's schedules: gradient
    #: sync and resharding off for all but a stage's last backward, so the stage's parameters
    #: stay gathered all step and its unsharded gradients accumulate in the reduce dtype)
    grad_sync: Literal["microbatch", "step"] = "microbatch"
    #: ZeRO stage of the data-parallel replicas (``dp_shard == 1``; fully_shard is ZeRO-3):
    #: 0 none; 1 the fp32 master weights and optimizer states partitioned over the replicas
    #: (compute-dtype parameters and gradients replicated); 2 the gradients too (Rajbhandari
    #: et al. 2020, sec. 5). Evaluated with ``--layout`` only: hyperpar has no ZeRO-1/2
    #: engine, so the search never proposes one
    zero: int = 0
    #: fully_shard over the cp ranks even with ``dp_shard == 1`` (torchtitan: FSDP runs
    #: whenever dp_shard or cp is > 1, over the flattened ``dp_shard x cp`` mesh); False
    #: (hyperpar's default): cp without dp_shard averages gradients with data_parallel and
    #: replicates the parameters
    cp_shard: bool = False

    def __post_init__(self) -> None:
        if self.grad_sync not in ("microbatch", "step"):
            raise ValueError(f"hyperpar plan: grad_sync {self.grad_sync!r}; accepted: "
                             "microbatch, step")
        if self.zero not in (0, 1, 2):
            raise ValueError(f"hyperpar plan: zero={self.zero!r}; accepted: 0, 1, 2 (ZeRO-3 "
                             "is fully_shard: write fsdpN)")
        if self.zero and self.dp_shard > 1:
            raise ValueError(f"hyperpar plan: zero{self.zero} with fsdp{self.dp_shard}: "
                             "fully_shard already partitions parameters, gradients and "
                             "optimizer states (ZeRO-3); use dpN.zero1/zero2 or fsdpN")

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks ``fully_shard`` shards each parameter over: ``dp_shard``, times ``cp`` when
        both are > 1 (the flattened ``dp_shard x cp`` group); 1 without fully_shard."""
        return self.dp_shard * self.cp if self.dp_shard > 1 or self.cp_shard else 1

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 and self.sp

    def size(self, dim: str) -> int:
        return int(getattr(self, dim))

    def stride(self, dim: str) -> int:
        """Distance in global rank between neighbours along ``dim`` (row-major mesh)."""
        inner = MESH_ORDER[MESH_ORDER.index(dim) + 1:]
        out = 1
        for d in inner:
            out *= self.size(d)
        return out

    @property
    def name(self) -> str:
        parts = [f"{d}{self.size(d)}" for d in ("dp_replicate", "dp_shard", "tp", "pp", "cp")
                 if self.size(d) > 1] or ["single"]
        parts = [p.replace("dp_replicate", "dp").replace("dp_shard", "fsdp") for p in parts]
        parts.append(f"mb{self.microbatches}")
        if self.pp > 1:
            parts.append(self.schedule)
            if self.virtual_stages > 1:
                parts.append(f"v{self.virtual_stages}")
        if self.activation_checkpointing:
            parts.append("ac" if self.ac_every == 1 else f"ac{self.ac_every}")
        if self.selective_ac:
            parts.append("sac")
        if self.loss_parallel:
            parts.append("lp")
        if not self.reshard_after_forward:
            parts.append("nrf")
        if not self.sp:
            parts.append("nosp")
        if self.grad_sync == "step":
            parts.append("gstep")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.cp_shard:
            parts.append("cpfs")
        return ".".join(parts)


_NAME_DIMS = {"dp": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "pp": "pp", "cp": "cp",
              "mb": "microbatches", "v": "virtual_stages"}


def parse_layout(name: str, schedule: Schedule = "1f1b", virtual_stages: int = 2) -> Layout:
    """The :class:`Layout` a name as :attr:`Layout.name` prints it stands for:
    ``dp8.fsdp128.tp8.pp16.mb16``, optionally ``.1f1b``/``.gpipe``, ``.ac`` and ``.lp`` (``single``:
    one rank). Dims left out are 1; ``schedule`` applies where the name gives none, and
    ``virtual_stages`` to an interleaved pipeline whose name gives no ``vN``."""
    fields: dict[str, object] = {"schedule": schedule}
    seen: set[str] = set()
    for part in name.strip().lower().split("."):
        match = re.fullmatch(r"(fsdp|dp|tp|pp|cp|mb|v)(\d+)", part)
        if match:
            key = _NAME_DIMS[match.group(1)]
            if key in seen:
                raise ValueError(f"hyperpar plan: layout {name!r} gives {match.group(1)} twice")
            seen.add(key)
            fields[key] = int(match.group(2))
            if fields[key] < 1:
                raise ValueError(f"hyperpar plan: layout {name!r}: {part} must be >= 1")
        elif part in SCHEDULES:
            fields["schedule"] = part
        elif part == "ac":
            fields["activation_checkpointing"] = True
        elif re.fullmatch(r"ac\d+", part):
            fields["activation_checkpointing"] = True
            fields["ac_every"] = int(part[2:])
            if fields["ac_every"] < 1:
                raise ValueError(f"hyperpar plan: layout {name!r}: {part} must be >= ac1 "
                                 "(acN: every N-th layer checkpointed)")
        elif part == "sac":
            fields["selective_ac"] = True
        elif part == "lp":
            fields["loss_parallel"] = True
        elif part == "nrf":
            fields["reshard_after_forward"] = False
        elif part == "nosp":
            fields["sp"] = False
        elif part == "gstep":
            fields["grad_sync"] = "step"
        elif part == "cpfs":
            fields["cp_shard"] = True
        elif part in ("zero1", "zero2"):
            fields["zero"] = int(part[4:])
        elif re.fullmatch(r"(ep|etp|nl|cap)\d+", part) or part == "dualpipe":
            raise ValueError(f"hyperpar plan: layout {name!r}: {part!r} is an MoE layout part "
                             "(expert parallelism, capacity, node-limited routing, DualPipe); "
                             "it needs an MoE config (the model here is dense): leave it out")
        elif part != "single":
            raise ValueError(
                f"hyperpar plan: layout {name!r}: {part!r} not understood; write the names "
                "the planner prints, parts joined by '.': dpN (dp_replicate), fsdpN "
                "(dp_shard), tpN, ppN, cpN, mbN (microbatches), a schedule "
                "(1f1b|gpipe|interleaved1f1b|zbh1), vN (virtual stages), ac (every layer) "
                "or acN (every N-th layer), sac (selective), lp (loss parallel), nrf (no "
                "reshard after forward), nosp (tp without sequence parallel), gstep (gradients "
                "reduce-scattered once per step, unsharded ones accumulated), zero1|zero2 "
                "(ZeRO over the dp replicas, evaluated only), cpfs (fully_shard over the cp "
                "ranks without dp_shard, as torchtitan), e.g. "
                "dp8.fsdp128.tp8.pp16.mb16")
    if (fields["schedule"] == "interleaved1f1b" and "virtual_stages" not in seen
            and int(fields.get("pp", 1)) > 1):  # type: ignore[call-overload]
        fields["virtual_stages"] = virtual_stages
    return Layout(**fields)  # type: ignore[arg-type]


def batch_problems(run: Run, dp: int, microbatches: int, pp: int) -> list[str]:
    """Why the global batch cannot be split over ``dp`` replicas, ``microbatches`` each, and
    keep ``pp`` stages busy (empty: it can); shared by the dense and the MoE layout checks."""
    out = []
    if run.global_batch % dp:
        out.append(f"global_batch={run.global_batch} % (dp_replicate*dp_shard)={dp} != 0")
    elif (run.global_batch // dp) % microbatches:
        out.append(f"per-replica batch {run.global_batch // dp} % microbatches={microbatches}"
                   " != 0")
    if pp > 1 and microbatches < pp:
        out.append(f"microbatches={microbatches} < pp={pp} leaves stages idle")
    return out
