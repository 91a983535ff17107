"""The ``llama`` family's structured config and its checks (torch-free).

SwiGLU hidden size (Meta's reference ``llama3/model.py``; Dubey et al. 2024, "The Llama 3
Herd of Models", Table 3): ``hidden = multiple_of * ceil(ffn_dim_multiplier * (2/3 * 4
dim) / multiple_of)`` (:func:`ffn_hidden_dim`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """LLaMA-3 model and training-step shape (Hydra structured config).

    Attributes:
        family: the model family (``llama``; see :mod:`pipeline.models`).
        name: short readable key used in result paths (``llama1b``).
        dim: model width; n_layers: decoder blocks; n_heads / n_kv_heads: query
            and key/value heads (GQA, ``n_heads % n_kv_heads == 0``).
        ffn_dim_multiplier, multiple_of: SwiGLU hidden size rule (see module doc).
        ffn_hidden_overrides: ``{layer index: hidden size}`` to give chosen
            layers another FFN width (used to test repeated-layer detection).
        rope_theta, norm_eps: RoPE base and RMSNorm epsilon.
        vocab_size, seq_len, batch_size: vocabulary, sequence length, global batch.
        microbatches: gradient accumulation: the step's batch runs as this many
            microbatches, one gradient reduction per step (docs/pipelining.md; checked
            with the mesh by ``pipeline.config.pipelining``).
        param_dtype, reduce_dtype: compute and gradient-reduction dtypes.
        trace_env: set by ``resolve()``: the versions the graph depends on
            (:func:`pipeline.models.trace_key`).
    """

    family: str = "llama"
    name: str = "llama1b"
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim_multiplier: float = 1.5
    multiple_of: int = 256
    ffn_hidden_overrides: dict[int, int] = field(default_factory=dict)
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    vocab_size: int = 128256
    seq_len: int = 2048
    batch_size: int = 16
    microbatches: int = 1
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    trace_env: dict[str, Any] = field(default_factory=dict)


ALLOWED_DTYPES = ("float32", "bfloat16", "float16")


def validate_model_config(cfg: Any) -> None:
    """Check a model config; raise ``ValueError`` with a one-line message.

    Errors name the key, the value and what is allowed, e.g.
    ``model.n_heads=6: must divide model.dim=64``.
    """
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "vocab_size",
                "seq_len", "batch_size"):
        val = cfg[key]
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"model.{key}={val!r}: must be a positive integer")
    if cfg["dim"] % cfg["n_heads"]:
        raise ValueError(
            f"model.n_heads={cfg['n_heads']}: must divide model.dim={cfg['dim']}")
    if cfg["n_heads"] % cfg["n_kv_heads"]:
        raise ValueError(
            f"model.n_kv_heads={cfg['n_kv_heads']}: must divide model.n_heads={cfg['n_heads']}")
    if (cfg["dim"] // cfg["n_heads"]) % 2:
        raise ValueError(
            f"model.n_heads={cfg['n_heads']}: head dim {cfg['dim'] // cfg['n_heads']} must be "
            "even for rotary embeddings")
    for key in ("param_dtype", "reduce_dtype"):
        if cfg[key] not in ALLOWED_DTYPES:
            raise ValueError(f"model.{key}={cfg[key]!r}: allowed {', '.join(ALLOWED_DTYPES)}")
    for layer, hidden in dict(cfg.get("ffn_hidden_overrides") or {}).items():
        if not 0 <= int(layer) < cfg["n_layers"] or int(hidden) < 1:
            raise ValueError(
                f"model.ffn_hidden_overrides={{{layer}: {hidden}}}: layer must be in "
                f"[0, {cfg['n_layers']}) and hidden size positive")
    if cfg.get("ffn_dim_multiplier") is not None and cfg["ffn_dim_multiplier"] <= 0:
        raise ValueError(
            f"model.ffn_dim_multiplier={cfg['ffn_dim_multiplier']}: must be positive")


def ffn_hidden_dim(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """SwiGLU hidden size of Meta's reference implementation (8192 for dim 2048, x1.5)."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
