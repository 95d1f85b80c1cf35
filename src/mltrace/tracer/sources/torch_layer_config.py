"""Constructor arguments of live ``torch.nn`` layers, recorded once per module as
``ml.layer.config`` so that DLBricks (``analysis/bricks.py``) can rebuild a layer exactly."""

from __future__ import annotations

import inspect
from typing import Any


def layer_config(module: Any) -> dict[str, Any] | None:
    """Constructor arguments of a live ``torch.nn`` layer, for the tracer to record.

    Meant for ``TorchModuleSource`` to store once per module as
    ``ml.layer.config`` (it never imports torch and reads no weights). Covers
    layers of ``torch.nn`` whose ``__init__`` arguments are attributes of the
    same name, plus ``bias`` and the attention/transformer layers; returns
    None for other modules (user-defined ones).
    """
    cls = type(module)
    if not cls.__module__.startswith("torch.nn.modules"):
        return None
    name = cls.__name__
    if name == "MultiheadAttention":
        return {
            "embed_dim": module.embed_dim,
            "num_heads": module.num_heads,
            "dropout": module.dropout,
            "bias": module.in_proj_bias is not None,
            "add_bias_kv": module.bias_k is not None,
            "kdim": module.kdim,
            "vdim": module.vdim,
            "batch_first": module.batch_first,
        }
    if name in ("TransformerEncoderLayer", "TransformerDecoderLayer"):
        act = {1: "relu", 2: "gelu"}.get(getattr(module, "activation_relu_or_gelu", 0))
        return {
            "d_model": module.self_attn.embed_dim,
            "nhead": module.self_attn.num_heads,
            "dim_feedforward": module.linear1.out_features,
            "dropout": module.dropout.p,
            "activation": act or getattr(module.activation, "__name__", "relu"),
            "layer_norm_eps": module.norm1.eps,
            "batch_first": module.self_attn.batch_first,
            "norm_first": module.norm_first,
            "bias": module.linear1.bias is not None,
        }
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None
    cfg: dict[str, Any] = {}
    for pname, param in sig.parameters.items():
        if pname in ("self", "device", "dtype") or pname.startswith("_") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if pname == "bias" and isinstance(param.default, bool):
            b = getattr(module, "bias", None)
            cfg["bias"] = b if isinstance(b, bool) else b is not None
            continue
        if not hasattr(module, pname):
            if param.default is inspect.Parameter.empty:
                return None  # a required argument we cannot see: not reconstructible
            continue
        value = getattr(module, pname)
        if isinstance(value, (bool, int, float, str)) or value is None:
            cfg[pname] = value
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
            cfg[pname] = list(value)
        elif param.default is inspect.Parameter.empty:
            return None
    return cfg
