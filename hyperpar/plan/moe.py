"""Mixture-of-Experts models as the planner sees them: which Hugging Face configs are MoE, and
the exact parameter counts (total, active per token) of Mixtral, Qwen2-MoE / Qwen3-MoE,
DeepSeek-V2 / V3 (multi-head latent attention, dense first layers, shared experts, multi-token
prediction modules) and gpt-oss (attention sinks, biased experts, sliding-window layers).

The dense planner (:mod:`hyperpar.plan.model`) refuses every config :func:`moe_keys` flags:
planned as dense, an MoE model would be given every expert's weights on every rank's
matmuls and no all-to-all, a prediction made up rather than made. This module is the model
half of MoE planning: counts and per-token FLOPs, checked against the published totals in
``tests/plan/test_moe.py``. No framework is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

#: HF config keys whose presence (with a value other than null / 0) marks a Mixture-of-Experts
#: model: Mixtral and gpt-oss ``num_local_experts``, Qwen-MoE ``num_experts``, DeepSeek
#: ``n_routed_experts``, and the keys every family shares.
MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts",
                   "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                   "shared_expert_intermediate_size", "experts_per_token", "moe_layer_freq",
                   "first_k_dense_replace")

Attention = Literal["gqa", "mla"]


def moe_keys(config: dict[str, Any]) -> list[str]:
    """The MoE keys ``config`` sets (empty for a dense model)."""
    return [k for k in MOE_CONFIG_KEYS if config.get(k) not in (None, 0, False)]


@dataclass(frozen=True)
class MoESpec:
    """Sizes of an MoE decoder. Each layer holds attention and either a dense SwiGLU MLP of
    ``dense_intermediate`` (the first ``first_dense`` layers, and any in ``dense_layers``) or
    ``experts`` routed SwiGLU experts of ``expert_intermediate``, ``top_k`` of them per token,
    beside ``shared_experts`` always-on experts of ``shared_intermediate`` each (Qwen2-MoE's
    single shared expert has its own width and a sigmoid gate of ``hidden`` weights).

    ``attention``: ``gqa`` (q/k/v/o with ``num_kv_heads`` key-value heads of ``head_dim``,
    optional q/k/v biases, per-head q/k norms, per-head sinks) or ``mla`` (DeepSeek's
    multi-head latent attention: a ``q_lora_rank`` down/up projection of the queries, or a
    direct one when 0, a ``kv_lora_rank`` joint key-value compression plus a shared rotary key
    of ``qk_rope_dim``, per-head ``qk_nope_dim`` / ``v_head_dim``).

    ``mtp``: DeepSeek-V3's multi-token-prediction modules (each: two norms, a ``2h -> h``
    projection and one MoE layer; embedding and head shared with the main model); published
    totals (671B) leave them out, so :attr:`parameters` does and :attr:`mtp_parameters` gives
    them. ``window`` / ``sliding_layers``: gpt-oss's banded attention (those layers attend to
    ``window`` tokens)."""

    name: str
    family: str
    hidden: int
    num_layers: int
    num_heads: int
    vocab: int
    experts: int
    top_k: int
    expert_intermediate: int
    dense_intermediate: int = 0
    first_dense: int = 0
    dense_layers: tuple[int, ...] = ()
    shared_experts: int = 0
    shared_intermediate: int = 0
    shared_gate: bool = False
    attention: Attention = "gqa"
    num_kv_heads: int = 0
    head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sinks: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    expert_bias: bool = False      # gpt-oss: biases on the experts' projections and router
    router_bias: bool = False      # DeepSeek-V3's e_score_correction_bias, gpt-oss's router bias
    tie_word_embeddings: bool = False
    mtp: int = 0
    window: int = 0
    sliding_layers: int = 0

    def __post_init__(self) -> None:
        for key in ("hidden", "num_layers", "num_heads", "vocab", "experts", "top_k",
                    "expert_intermediate"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {key} must be a positive integer, "
                                 f"got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(f"model {self.name!r}: {self.top_k} experts per token of "
                             f"{self.experts}")
        if self.first_dense + len(self.dense_layers) and not self.dense_intermediate:
            raise ValueError(f"model {self.name!r}: dense layers need intermediate_size")

    # -- per layer -------------------------------------------------------------------------
    @property
    def moe_layers(self) -> int:
        dense = set(range(self.first_dense)) | set(self.dense_layers)
        return self.num_layers - len(dense & set(range(self.num_layers)))

    @property
    def dense_layer_count(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def attention_params(self) -> int:
        """One layer's attention weights (and its norms: the pre-attention RMSNorm included)."""
        h, n = self.hidden, self.num_heads
        if self.attention == "mla":
            qk = self.qk_nope_dim + self.qk_rope_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk
            else:
                q = h * n * qk
            kv = (h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * n * (self.qk_nope_dim + self.v_head_dim))
            return q + kv + n * self.v_head_dim * h + h
        q, kv = n * self.head_dim, self.num_kv_heads * self.head_dim
        out = h * q + 2 * h * kv + q * h + h
        if self.qkv_bias:
            out += q + 2 * kv
        if self.o_bias:
            out += h
        if self.qk_norm:
            out += 2 * self.head_dim
        if self.sinks:
            out += n
        return out

    def _swiglu(self, width: int, bias: bool = False) -> int:
        return 3 * self.hidden * width + (2 * width + self.hidden if bias else 0)

    @property
    def expert_params(self) -> int:
        """One routed expert's weights."""
        return self._swiglu(self.expert_intermediate, self.expert_bias)

    @property
    def shared_params(self) -> int:
        """All shared experts of one MoE layer (and Qwen2-MoE's shared-expert gate)."""
        width = self.shared_intermediate or self.expert_intermediate
        return self.shared_experts * self._swiglu(width) + (self.hidden if self.shared_gate
                                                             else 0)

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts + (self.experts if self.router_bias else 0)

    @property
    def moe_layer_params(self) -> int:
        """One MoE layer: attention, the post-attention norm, router, routed and shared
        experts."""
        return (self.attention_params + self.hidden + self.router_params
                + self.experts * self.expert_params + self.shared_params)

    @property
    def dense_layer_params(self) -> int:
        return self.attention_params + self.hidden + self._swiglu(self.dense_intermediate)

    @property
    def embed_params(self) -> int:
        """Embedding, final norm and (untied) head."""
        head = 0 if self.tie_word_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.hidden + head

    # -- totals ----------------------------------------------------------------------------
    @property
    def parameters(self) -> int:
        """Every parameter of the main model (the MTP modules apart)."""
        return (self.moe_layers * self.moe_layer_params
                + self.dense_layer_count * self.dense_layer_params + self.embed_params)

    @property
    def routed_parameters(self) -> int:
        """The routed experts' weights, all layers (what expert parallelism splits)."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def mtp_parameters(self) -> int:
        """The multi-token-prediction modules: per module two norms, the ``2h -> h``
        projection, one MoE layer and its final norm (DeepSeek-V3: 11.6B; the checkpoint's 685B
        also stores the module's own copies of the embedding and head, 1.9B)."""
        h = self.hidden
        return self.mtp * (2 * h + 2 * h * h + self.moe_layer_params + h)

    @property
    def active_parameters(self) -> int:
        """Parameters one token uses: all but the ``experts - top_k`` unrouted experts of each
        MoE layer (embedding and head included, as Mixtral's 12.9B and Qwen3's 3.3B count)."""
        return self.parameters - self.moe_layers * (self.experts - self.top_k) * self.expert_params

    @property
    def active_matmul_parameters(self) -> int:
        """The ``P`` of ``6 P tokens``: active weights in a matmul per token (the embedding
        lookup, norms, biases and sinks left out; the head counted). gpt-oss's published
        "active parameters" (3.61B, 5.13B) are this count."""
        h = self.hidden
        per_moe = (self.top_k * 3 * h * self.expert_intermediate
                   + self.shared_experts * 3 * h * (self.shared_intermediate
                                                    or self.expert_intermediate)
                   + h * self.experts + (h if self.shared_gate else 0))
        per_dense = 3 * h * self.dense_intermediate
        return (self.num_layers * self._attention_matmul + self.moe_layers * per_moe
                + self.dense_layer_count * per_dense + self.vocab * h)

    @property
    def _attention_matmul(self) -> int:
        h, n = self.hidden, self.num_heads
        if self.attention == "mla":
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank
                 else h * n * qk)
            return (q + h * (self.kv_lora_rank + self.qk_rope_dim)
                    + self.kv_lora_rank * n * (self.qk_nope_dim + self.v_head_dim)
                    + n * self.v_head_dim * h)
        q, kv = n * self.head_dim, self.num_kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token of the score and value matmuls, all layers,
        causal (half the ``seq x seq`` pairs; a sliding layer attends to at most ``window``
        keys): ``6 x 2 x heads x (qk_dim + v_dim) x keys / 2`` per layer."""
        if self.attention == "mla":
            dims = self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim
        else:
            dims = 2 * self.head_dim
        full = self.num_layers - self.sliding_layers
        keys = full * seq_len / 2 + self.sliding_layers * min(self.window or seq_len,
                                                              seq_len / 2)
        return 6 * self.num_heads * dims * keys

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6 x active matmul params + attention``."""
        return 6 * self.active_matmul_parameters + self.attention_flops_per_token(seq_len)


def _need(config: dict[str, Any], keys: tuple[str, ...], family: str) -> None:
    missing = [k for k in keys if config.get(k) in (None, "")]
    if missing:
        raise ValueError(f"hyperpar plan: the {family} MoE config lacks {missing}")


def moe_from_hf_config(config: dict[str, Any], name: str | None = None) -> MoESpec:
    """An :class:`MoESpec` from a Hugging Face config (parsed): ``model_type`` ``mixtral``,
    ``qwen2_moe``, ``qwen3_moe``, ``deepseek_v2``, ``deepseek_v3`` or ``gpt_oss``; any other
    MoE ``model_type`` is refused with the list."""
    mt = str(config.get("model_type") or "")
    name = name or str(config.get("_name_or_path") or mt or "moe")
    c = config
    base = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    common: dict[str, Any] = {}
    if mt in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"):
        _need(c, base, mt)
        heads = int(c["num_attention_heads"])
        common = dict(num_kv_heads=int(c.get("num_key_value_heads") or heads),
                      head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads))
    if mt == "mixtral":
        _need(c, ("num_local_experts", "num_experts_per_tok", "intermediate_size"), mt)
        return MoESpec(name=name, family=mt, hidden=int(c["hidden_size"]),
                       num_layers=int(c["num_hidden_layers"]), num_heads=heads,
                       vocab=int(c["vocab_size"]), experts=int(c["num_local_experts"]),
                       top_k=int(c["num_experts_per_tok"]),
                       expert_intermediate=int(c["intermediate_size"]),
                       tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), **common)
    if mt in ("qwen2_moe", "qwen3_moe"):
        _need(c, ("num_experts", "num_experts_per_tok", "moe_intermediate_size"), mt)
        layers = int(c["num_hidden_layers"])
        step = int(c.get("decoder_sparse_step") or 1)
        dense = set(int(i) for i in (c.get("mlp_only_layers") or []))
        dense |= {i for i in range(layers) if (i + 1) % step}
        shared = int(c.get("shared_expert_intermediate_size") or 0)
        return MoESpec(name=name, family=mt, hidden=int(c["hidden_size"]), num_layers=layers,
                       num_heads=heads, vocab=int(c["vocab_size"]),
                       experts=int(c["num_experts"]), top_k=int(c["num_experts_per_tok"]),
                       expert_intermediate=int(c["moe_intermediate_size"]),
                       dense_intermediate=int(c.get("intermediate_size") or 0),
                       dense_layers=tuple(sorted(dense)),
                       shared_experts=1 if shared else 0, shared_intermediate=shared,
                       shared_gate=bool(shared), qkv_bias=mt == "qwen2_moe",
                       qk_norm=mt == "qwen3_moe",
                       tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), **common)
    if mt == "gpt_oss":
        _need(c, ("num_local_experts", "intermediate_size"), mt)
        types = list(c.get("layer_types") or [])
        return MoESpec(name=name, family=mt, hidden=int(c["hidden_size"]),
                       num_layers=int(c["num_hidden_layers"]), num_heads=heads,
                       vocab=int(c["vocab_size"]), experts=int(c["num_local_experts"]),
                       top_k=int(c.get("num_experts_per_tok") or c.get("experts_per_token")
                                 or 4),
                       expert_intermediate=int(c["intermediate_size"]), qkv_bias=True,
                       o_bias=True, sinks=True, expert_bias=True, router_bias=True,
                       window=int(c.get("sliding_window") or 0),
                       sliding_layers=sum(t == "sliding_attention" for t in types),
                       tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), **common)
    if mt in ("deepseek_v2", "deepseek_v3"):
        _need(c, base + ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                         "v_head_dim", "intermediate_size"), mt)
        layers = int(c["num_hidden_layers"])
        freq = int(c.get("moe_layer_freq") or 1)
        first = int(c.get("first_k_dense_replace") or 0)
        dense = tuple(i for i in range(first, layers) if i % freq)
        return MoESpec(name=name, family=mt, hidden=int(c["hidden_size"]), num_layers=layers,
                       num_heads=int(c["num_attention_heads"]), vocab=int(c["vocab_size"]),
                       experts=int(c["n_routed_experts"]),
                       top_k=int(c["num_experts_per_tok"]),
                       expert_intermediate=int(c["moe_intermediate_size"]),
                       dense_intermediate=int(c["intermediate_size"]), first_dense=first,
                       dense_layers=dense, shared_experts=int(c.get("n_shared_experts") or 0),
                       attention="mla", q_lora_rank=int(c.get("q_lora_rank") or 0),
                       kv_lora_rank=int(c["kv_lora_rank"]),
                       qk_nope_dim=int(c["qk_nope_head_dim"]),
                       qk_rope_dim=int(c["qk_rope_head_dim"]), v_head_dim=int(c["v_head_dim"]),
                       router_bias=c.get("topk_method") == "noaux_tc",
                       tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                       mtp=int(c.get("num_nextn_predict_layers") or 0))
    raise ValueError(f"hyperpar plan: MoE model_type {mt!r} is not modelled; accepted: "
                     "mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3, gpt_oss")
