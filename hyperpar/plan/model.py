"""What the planner knows about a model: the sizes of a decoder (Llama-family or GPT-style) and
the exact shape of every parameter tensor, with the dimension tensor parallelism splits.

Built from a Hugging Face ``config.json`` (:func:`from_hf_config`) or from the sizes of the
examples' models (:func:`example_spec`). No framework is imported here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .moe import moe_keys

Group = Literal["embed", "block", "final"]
#: ``llama``: RMSNorm, rotary, SwiGLU, no biases. ``gpt``: LayerNorm (weight and bias), GeLU
#: MLP of ``intermediate_size``, biases on every linear, learned positions when
#: ``max_positions`` > 0 (GPT-2; GPT-NeoX uses rotary: 0).
Block = Literal["llama", "gpt"]

#: HF config keys the planner reads (all required except the last three).
HF_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "vocab_size")


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: its full shape, the dim ColwiseParallel/RowwiseParallel split
    (``None``: replicated over tp, e.g. norms) and where it lives (``embed``: first pipeline
    stage, ``block``: one per layer, ``final``: last stage)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    group: Group

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a decoder: ``block="llama"`` (RMSNorm, rotary attention with grouped KV heads,
    SwiGLU feed-forward, no biases) or ``block="gpt"`` (LayerNorm, GeLU MLP, biases, learned
    positions when ``max_positions`` > 0). ``dropout``: the block applies dropout after
    attention's projection and the MLP and to attention's probabilities, keeping a one-byte
    mask per element for backward (GPT-2's ``resid_pdrop``/``attn_pdrop`` > 0)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    block: Block = "llama"
    max_positions: int = 0
    dropout: bool = False

    def __post_init__(self) -> None:
        if self.block not in ("llama", "gpt"):
            raise ValueError(f"model {self.name!r}: block {self.block!r}; accepted: llama, gpt")
        if self.block == "llama" and (self.max_positions or self.dropout):
            raise ValueError(f"model {self.name!r}: learned positions and dropout are modelled "
                             "for block='gpt' only")
        for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "vocab_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {key} must be a positive integer, "
                                 f"got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: num_attention_heads={self.num_heads} is not "
                             f"a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"model {self.name!r}: hidden_size={self.hidden_size} is not a "
                             f"multiple of num_attention_heads={self.num_heads}; give head_dim")

    @property
    def hd(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.hd

    def block_tensors(self) -> list[ParamTensor]:
        """The parameters of one decoder layer."""
        h, f = self.hidden_size, self.intermediate_size
        if self.block == "gpt":  # biases split like their weight's output dim
            return [
                ParamTensor("ln_1.weight", (h,), None, "block"),
                ParamTensor("ln_1.bias", (h,), None, "block"),
                ParamTensor("attn.wq.weight", (self.q_dim, h), 0, "block"),
                ParamTensor("attn.wq.bias", (self.q_dim,), 0, "block"),
                ParamTensor("attn.wk.weight", (self.kv_dim, h), 0, "block"),
                ParamTensor("attn.wk.bias", (self.kv_dim,), 0, "block"),
                ParamTensor("attn.wv.weight", (self.kv_dim, h), 0, "block"),
                ParamTensor("attn.wv.bias", (self.kv_dim,), 0, "block"),
                ParamTensor("attn.wo.weight", (h, self.q_dim), 1, "block"),
                ParamTensor("attn.wo.bias", (h,), None, "block"),
                ParamTensor("ln_2.weight", (h,), None, "block"),
                ParamTensor("ln_2.bias", (h,), None, "block"),
                ParamTensor("mlp.fc1.weight", (f, h), 0, "block"),
                ParamTensor("mlp.fc1.bias", (f,), 0, "block"),
                ParamTensor("mlp.fc2.weight", (h, f), 1, "block"),
                ParamTensor("mlp.fc2.bias", (h,), None, "block"),
            ]
        return [
            ParamTensor("attention_norm.weight", (h,), None, "block"),
            ParamTensor("attention.wq.weight", (self.q_dim, h), 0, "block"),
            ParamTensor("attention.wk.weight", (self.kv_dim, h), 0, "block"),
            ParamTensor("attention.wv.weight", (self.kv_dim, h), 0, "block"),
            ParamTensor("attention.wo.weight", (h, self.q_dim), 1, "block"),
            ParamTensor("ffn_norm.weight", (h,), None, "block"),
            ParamTensor("feed_forward.w1.weight", (f, h), 0, "block"),
            ParamTensor("feed_forward.w3.weight", (f, h), 0, "block"),
            ParamTensor("feed_forward.w2.weight", (h, f), 1, "block"),
        ]

    def embed_tensors(self) -> list[ParamTensor]:
        """Token embedding (vocabulary-parallel: rows split over tp) and learned positions
        (replicated over tp)."""
        out = [ParamTensor("tok_embeddings.weight", (self.vocab_size, self.hidden_size), 0,
                           "embed")]
        if self.max_positions:
            out.append(ParamTensor("pos_embeddings.weight", (self.max_positions,
                                                             self.hidden_size), None, "embed"))
        return out

    def final_tensors(self, *, pipeline: bool = False) -> list[ParamTensor]:
        """Final norm and output head. A tied head owns no tensor of its own, except on a
        separate last pipeline stage, which keeps a copy of the embedding (TiedLayerSpec)."""
        out = [ParamTensor("norm.weight", (self.hidden_size,), None, "final")]
        if self.block == "gpt":
            out.append(ParamTensor("norm.bias", (self.hidden_size,), None, "final"))
        if not self.tie_word_embeddings or pipeline:
            out.append(ParamTensor("output.weight", (self.vocab_size, self.hidden_size), 0,
                                   "final"))
        return out

    @property
    def block_params(self) -> int:
        return sum(t.numel for t in self.block_tensors())

    @property
    def parameters(self) -> int:
        """Exact number of parameters (a tied head counted once)."""
        return (sum(t.numel for t in self.embed_tensors()) + self.num_layers * self.block_params
                + sum(t.numel for t in self.final_tensors()))

    @property
    def matmul_parameters(self) -> int:
        """Parameters that take part in a matmul per token (every weight but the embedding
        lookup, the norms and the biases): the ``P`` of the ``6 * P * tokens`` FLOP estimate."""
        per_block = sum(t.numel for t in self.block_tensors() if is_matmul(t))
        return self.num_layers * per_block + self.vocab_size * self.hidden_size


def is_matmul(t: ParamTensor) -> bool:
    """Whether ``t`` is a linear layer's weight (split over tp, two dims)."""
    return t.tp_dim is not None and len(t.shape) == 2


#: GPT-2 config keys and the names :func:`from_hf_config` reads them as.
GPT2_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
             "n_head": "num_attention_heads"}


def _gpt_spec(config: dict[str, Any], name: str) -> ModelSpec:
    """GPT-2 (``model_type`` gpt2: ``n_embd``, ``n_layer``, ``n_head``, ``n_inner`` (default
    4h), ``n_positions``, tied head by default, dropout from ``resid_pdrop``/``attn_pdrop``)
    or GPT-NeoX (``gpt_neox``: the Llama key names, rotary, untied head by default, dropout
    from ``hidden_dropout``/``attention_dropout``)."""
    c = dict(config)
    gpt2 = c.get("model_type") == "gpt2"
    if gpt2:
        for key, ours in GPT2_KEYS.items():
            if key in c:
                c.setdefault(ours, c[key])
        if "hidden_size" in c and not c.get("intermediate_size"):
            c["intermediate_size"] = c.get("n_inner") or 4 * int(c["hidden_size"])
    missing = [k for k in HF_KEYS if k not in c]
    if missing:
        raise ValueError(f"hyperpar plan: the {c.get('model_type')} config lacks {missing} "
                         f"(GPT-2 names: {sorted(GPT2_KEYS)}, vocab_size)")
    drops = (("resid_pdrop", "attn_pdrop") if gpt2 else ("hidden_dropout", "attention_dropout"))
    heads = int(c["num_attention_heads"])
    return ModelSpec(
        name=name, hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads,
        vocab_size=int(c["vocab_size"]),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", gpt2)), block="gpt",
        max_positions=int(c.get("n_positions") or 0) if gpt2 else 0,
        dropout=any(float(c.get(k) or 0) > 0 for k in drops))


def from_hf_config(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` (a path or the parsed dict):
    ``model_type`` gpt2 or gpt_neox gives a GPT-style block (:func:`_gpt_spec`), anything else
    is read as a Llama-family decoder. Reads ``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``vocab_size``, and optionally
    ``num_key_value_heads`` (default: the number of heads), ``tie_word_embeddings`` (default
    false) and ``head_dim``."""
    if not isinstance(config, dict):
        path = Path(config)
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"hyperpar plan: config file {str(path)!r} does not exist; "
                                    "give the path of a Hugging Face config.json") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"hyperpar plan: {str(path)!r} is not valid JSON ({err})") from None
        name = name or path.stem
    assert isinstance(config, dict)
    refuse_moe(config, name)
    if config.get("model_type") in ("gpt2", "gpt_neox"):
        return _gpt_spec(config, name or str(config.get("_name_or_path")
                                             or config["model_type"]))
    missing = [k for k in HF_KEYS if k not in config]
    if missing:
        raise ValueError(
            f"hyperpar plan: the config lacks {missing}; the planner models Llama-family "
            f"decoders (and model_type gpt2 / gpt_neox) and needs {list(HF_KEYS)} (plus "
            "optionally num_key_value_heads, tie_word_embeddings, head_dim)")
    heads = int(config["num_attention_heads"])
    return ModelSpec(
        name=name or str(config.get("_name_or_path") or config.get("model_type") or "model"),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
    )


def refuse_moe(config: dict[str, Any], name: str | None = None) -> None:
    """Raise for a Mixture-of-Experts config (:func:`hyperpar.plan.moe.moe_keys`): planned as
    a dense decoder its memory and step time would be those of another model (each layer's
    MLP one expert wide, or every expert in every token's matmuls; no all-to-all), so the
    planner refuses it rather than make a prediction up."""
    keys = moe_keys(config)
    if keys:
        label = name or config.get("_name_or_path") or config.get("model_type") or "the model"
        raise ValueError(
            f"{label} is a Mixture-of-Experts model (its config sets {', '.join(keys)}); "
            "the planner's layouts, memory and step time model dense decoders only "
            "(no expert parallelism, no all-to-all, no routed-expert states), so it refuses "
            "to plan it rather than predict a dense model's figures. Its parameter counts "
            "(total, active per token) are hyperpar.plan.moe.moe_from_hf_config(config)")


#: Sizes of ``examples/llama/model.py``'s ``ModelArgs.tiny()`` and ``ModelArgs()`` (no GQA,
#: untied head); kept in sync by tests/plan/test_model.py, which builds both and counts.
EXAMPLES: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "ffn_hidden": 64,
             "max_seq_len": 16},
    "llama": {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 128,
              "max_seq_len": 64},
}


def example_spec(name: str) -> ModelSpec:
    """The model of ``examples/llama`` (``tiny``: ``ModelArgs.tiny()``, ``llama``:
    ``ModelArgs()``)."""
    if name not in EXAMPLES:
        raise ValueError(f"hyperpar plan: unknown example {name!r}; choose one of "
                         f"{sorted(EXAMPLES)}")
    return spec_from_model_args(EXAMPLES[name], name=f"examples/llama {name}")


def spec_from_model_args(a: dict[str, int], name: str = "examples/llama") -> ModelSpec:
    """The spec of ``examples/llama/model.py``'s ``ModelArgs(**a)`` (keys ``vocab_size``,
    ``dim``, ``n_layers``, ``n_heads``, ``ffn_hidden``)."""
    return ModelSpec(name=name, hidden_size=a["dim"], intermediate_size=a["ffn_hidden"],
                     num_layers=a["n_layers"], num_heads=a["n_heads"],
                     num_kv_heads=a["n_heads"], vocab_size=a["vocab_size"])
