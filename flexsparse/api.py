"""flexsparse.attention: validate, compile the mask, pick a backend, call the op."""
import math
from typing import Optional, Tuple, Union

import torch

from . import flex
from . import masks as masks_mod
from .descriptor import BlockDescriptor, check_sizes, dim_in
from .ops import backends
from .ops import kernel_options as kernel_options_mod
from .ops import mask_checks
from .ops.schema import MASK_TENSOR_NAMES, attention_with_grad, cuda_attention_with_grad

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BACKENDS = ("auto", "reference", "triton", "cuda")


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask=None, *,
              bias: Optional[torch.Tensor] = None, scale: Optional[float] = None,
              softcap: Optional[float] = None, return_lse: bool = False,
              backend: str = "auto", deterministic: bool = False,
              block_size: Tuple[int, int] = masks_mod.DEFAULT_BLOCK_SIZE,
              kernel_options: Optional[dict] = None,
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Masked/sparse attention. See README and docs/semantics.md.

    query (B, Hq, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv); Hq % Hkv == 0.
    mask: None, a bool tensor, a `flexsparse.masks` mask, a compiled `BlockDescriptor`,
    or a FlexAttention `BlockMask`. Returns out (B, Hq, Lq, Dv), and lse (B, Hq, Lq)
    when `return_lse`. `kernel_options`: per-call choices of the Triton block kernels
    (`flexsparse/ops/kernel_options.py`: bwd_mode, trim_lists, dq_from_ds, *_config);
    other backends ignore them.
    """
    _check_qkv(query, key, value)
    for name, flag in (("return_lse", return_lse), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: must be a bool, got {masks_mod.shown(flag)}")
    if isinstance(bias, torch.Tensor) and 2 <= bias.dim() < 4:
        # SDPA's rule: missing leading dims broadcast; the gradient keeps the bias's shape.
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    block_size = masks_mod.block_pair(block_size)
    desc = compile_mask(mask, B, Hq, Hkv, Lq, Lk, device=query.device, block_size=block_size)
    _check_bias(bias, query, B, Hq, Hkv, Lq, Lk)
    # Types while tracing; values eagerly here, and under torch.compile by the op's kernel
    # when the graph runs (a float argument is traced symbolically: comparing it here
    # would fail to trace or specialize the graph on its value; mask_checks.check_scalars).
    compiling = torch.compiler.is_compiling()
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale: must be a float, got {type(scale).__name__}")
    softcap_given = softcap is not None    # (a bool while tracing too, unlike the value)
    if softcap is None:
        softcap = 0.0                  # 0: no softcap (as in the op, and flash-attn's API)
    elif not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
        raise TypeError(f"softcap: must be a float or None, got {type(softcap).__name__}")
    if not compiling:
        mask_checks.check_scalars(float(scale), float(softcap))     # as the op sees them
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"backend: must be one of {_BACKENDS}, got "
                         f"{masks_mod.shown(backend)}")
    options = kernel_options_mod.from_dict(kernel_options)
    mt = desc.mask_tensors()
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, bias))
    if backend == "auto":
        backend = backends.choose(query, key, value, bias, mt, needs_grad, desc.block_size,
                                  deterministic, softcap_given)
    else:
        reasons = backends.call_not_supported_reasons(backend, query, key, value, bias, mt,
                                                      *desc.block_size, needs_grad,
                                                      deterministic)
        if reasons:
            raise ValueError(f"backend: {backend!r} cannot run these inputs: {'; '.join(reasons)}")
    tail = (desc.block_size[0], desc.block_size[1], float(scale), float(softcap))
    if backend == "cuda" and mask_checks.debug_enabled():
        # FLEXSPARSE_DEBUG=1: the op's Python kernel checks the mask tensors' values for
        # the other backends (eager and when a compiled graph runs); the CUDA op's C++
        # kernel does not, so here: on the host eagerly, as graph asserts when compiling.
        check = (mask_checks.assert_mask_data if torch.compiler.is_compiling()
                 else mask_checks.check_mask_data)
        check(mt, Lq, Lk, *desc.block_size)
    if backend == "cuda":
        # The CUDA backend's own op: a compiled graph calls its C++ kernel directly.
        out, lse = cuda_attention_with_grad(query, key, value, bias, *mt, *tail,
                                            bool(deterministic))
    else:
        # the options travel in the op's backend string (the schema has no dict)
        out, lse = attention_with_grad(query, key, value, bias, *mt, *tail,
                                       kernel_options_mod.encode(backend, options),
                                       bool(deterministic))
    return (out, lse) if return_lse else out


def compile_mask(mask, B, Hq, Hkv, Lq, Lk, *, device, block_size=masks_mod.DEFAULT_BLOCK_SIZE
                 ) -> BlockDescriptor:
    """Whatever the user passed as `mask`, as a BlockDescriptor for these sizes."""
    if isinstance(mask, BlockDescriptor):
        if not torch.compiler.is_compiling() and _descriptor_fits(mask, B, Hq, Hkv, Lq, Lk, device):
            return mask
        # check_sizes: eager a ValueError here; under torch.compile (symbolic sizes) a graph
        # op that raises the same ValueError, with the numbers, when the graph runs.
        check_sizes((Lq, Lk), mask.seq_lengths,
                    "mask: descriptor was compiled for (Lq, Lk)={want}, inputs have {got}")
        check_sizes((Hq, Hkv), mask.num_heads,
                    "mask: descriptor was compiled for (Hq, Hkv)={want}, inputs have {got}")
        if mask.device != masks_mod.canonical_device(device):
            raise ValueError(f"mask: descriptor is on {mask.device}, inputs on {device}")
        mt = mask.mask_tensors()
        for i in _BATCHED_MASK_TENSORS:
            name, t = mt._fields[i], mt[i]
            if t is not None and not dim_in(t.shape[0], 1):
                check_sizes((t.shape[0],), (B,),
                            f"mask: descriptor tensor {name} has batch {{got}}, inputs have "
                            f"B={{want}} (it must be 1 or B)")
        return mask
    if mask is None:
        mask = masks_mod.full()
    elif isinstance(mask, torch.Tensor):
        mask = masks_mod.dense(mask)            # 2-D to 4-D, SDPA's broadcasting
    elif _is_flex_block_mask(mask):
        mask = flex.converted(mask)          # once per BlockMask object (its layers share it)
    if not isinstance(mask, masks_mod.Mask):
        raise TypeError(f"mask: expected None, a bool tensor, a flexsparse mask, a BlockDescriptor "
                        f"or a FlexAttention BlockMask, got {type(mask).__name__}")
    return mask.compile(B, Hq, Hkv, Lq, Lk, device=device, block_size=block_size)


# The mask tensors with a batch dim (1 or B): all but the bitmap pool (P, block_q, words)
# and the window (2,); positions in MaskTensors.
_BATCHED_MASK_TENSORS = tuple(i for i, name in enumerate(MASK_TENSOR_NAMES)
                              if name not in ("partial_bits", "window"))


def _descriptor_fits(desc, B, Hq, Hkv, Lq, Lk, device) -> bool:
    """Eagerly, whether a descriptor passes compile_mask's checks below (sizes, heads,
    device, every batched mask tensor's batch 1 or B), in ~2 µs of host time against their
    ~15 (perf-notes C124); when False those checks run and name what differs."""
    if desc.seq_lengths != (Lq, Lk) or desc.num_heads != (Hq, Hkv) or desc.device != device:
        return False
    mt = desc.mask_tensors()
    for i in _BATCHED_MASK_TENSORS:
        t = mt[i]
        if t is not None and t.shape[0] != 1 and t.shape[0] != B:
            return False
    return True


def _is_flex_block_mask(mask) -> bool:
    return type(mask).__name__ == "BlockMask" and hasattr(mask, "kv_num_blocks")


def _check_qkv(query, key, value):
    if not torch.compiler.is_compiling() and _qkv_fit(query, key, value):
        return
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype must be float16, bfloat16, float32 or float64, "
                            f"got {t.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} must match query dtype {query.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name}: is on {t.device} but query is on {query.device}")
        if t.shape[0] != query.shape[0]:
            raise ValueError(f"{name}: batch {t.shape[0]} must match query batch {query.shape[0]}")
    if value.shape[1] != key.shape[1]:
        raise ValueError(f"value: has {value.shape[1]} heads but key has {key.shape[1]}")
    if value.shape[2] != key.shape[2]:
        raise ValueError(f"value: length {value.shape[2]} must match key length {key.shape[2]}")
    if query.shape[3] == 0:
        raise ValueError(f"query: head dim must be > 0, got shape {tuple(query.shape)}")
    if key.shape[3] != query.shape[3]:
        raise ValueError(f"key: head dim {key.shape[3]} must match query head dim {query.shape[3]}")
    Hq, Hkv = query.shape[1], key.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"key: query heads Hq={Hq} must be a multiple of key/value heads Hkv={Hkv}")


def _qkv_fit(query, key, value) -> bool:
    """Eagerly, whether plain tensors pass _check_qkv's checks, in ~2 µs against its ~9;
    when False (or for other types) the checks run and name what is wrong."""
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor):
        return False
    qs, ks, vs = query.shape, key.shape, value.shape
    dtype, device = query.dtype, query.device
    return (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and dtype in _DTYPES
            and key.dtype == dtype and value.dtype == dtype
            and key.device == device and value.device == device
            and ks[0] == qs[0] and vs[0] == qs[0] and vs[1] == ks[1] and vs[2] == ks[2]
            and qs[3] != 0 and ks[3] == qs[3] and ks[1] != 0 and qs[1] % ks[1] == 0)


def _check_bias(bias, query, B, Hq, Hkv, Lq, Lk):
    if bias is None:
        return
    mask_checks.check_bias_tensor(bias, query)
    if bias.dim() != 4:
        raise ValueError(f"bias: must be 4-D (B|1, H|1, Lq|1, Lk|1), got shape {tuple(bias.shape)}")
    b, h, lq, lk = bias.shape
    if not (dim_in(b, 1, B) and dim_in(h, 1, Hkv, Hq) and dim_in(lq, 1, Lq)
            and dim_in(lk, 1, Lk)):
        raise ValueError(f"bias: shape {tuple(bias.shape)} is not broadcastable to "
                         f"(B={B}, Hq={Hq} or Hkv={Hkv}, Lq={Lq}, Lk={Lk})")
