"""Hugging Face transformers backend: `attn_implementation="flexsparse"`.

    from flexsparse.integrations import transformers as fs_hf
    fs_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexsparse")

`register()` adds the name to both of transformers' registries (5.x): the attention
function (`AttentionInterface`) and the mask function (`AttentionMaskInterface`). Without
the mask function transformers would pass no mask at all.

Masks. The mask function is transformers' own SDPA mask builder: it returns None when
the layer's mask is plain causal attention without padding (then this backend uses
`masks.causal()`, an O(N) descriptor, aligned bottom-right, so that decoding with a KV
cache is right), else a boolean (B, 1, Lq, Lk) mask that already holds padding, packed
sequences (from position_ids), sliding windows and chunked attention; it is passed to
flexsparse as a dense mask. Softcap (Gemma 2), scaling and GQA are passed through.
"""
import torch

import flexsparse
from flexsparse import masks

NAME = "flexsparse"


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, softcap=None, **kwargs):
    """transformers' attention-function contract: q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D);
    returns (out (B, Lq, Hq, D), None)."""
    if dropout and module.training:
        raise ValueError(f"dropout: attention dropout is not supported by flexsparse, got {dropout}")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions: flexsparse does not materialize attention weights")
    Lq = query.shape[2]
    bias = None
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask = masks.causal() if (causal and Lq > 1) else None
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask
    else:   # an additive float mask (0 / large negative): a bias
        mask, bias = None, attention_mask.to(query.dtype)
    out = flexsparse.attention(query, key, value, mask, bias=bias, scale=scaling,
                               softcap=softcap or None)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `attn_implementation="flexsparse"` available (transformers >= 5)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
