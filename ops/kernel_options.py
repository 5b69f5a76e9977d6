"""Per-call kernel options (like FlexAttention's `kernel_options`), for the Triton kernels:
`flexsparse.attention(..., kernel_options={"bwd_mode": "two_pass"})`.

The op schemas have no slot for a dict, and must not change (the C++ kernels of the CUDA
backend's ops are registered against them), so the options travel inside the op's
`backend` string: "triton" without options, "triton;bwd_mode=two_pass;trim_lists=0" with
some. `encode` writes that string (in one canonical form, so equal options give equal
strings and torch.compile sees one constant), `decode` reads it back. Backends that have
no use for an option ignore it.

Options (all optional; the defaults are what the kernels do without options):
  bwd_mode     "auto" | "two_pass" | "one_launch" | "atomic_dq": the structure of the
               backward (ops/triton_block.py describes each; "auto" picks by head dim)
  trim_lists   bool, default True: read facts of each new descriptor on the host (one
               sync each, cached): the range slots each block list uses (the kernels
               skip the others), the column-range slot kinds (one bound compared where
               all starts are 0 or all ends Lq) and the forward's mean blocks per row
               (short-row tiles). False: no host read of mask data, the general forms
               (masks rebuilt every step; A/B timing)
  dq_from_ds   bool, default True: with a full-shape dbias, the dQ pass reads the stored dS
               instead of recomputing it
  fwd_config, dkdv_config, dq_config
               (BLOCK_M, BLOCK_N, num_warps, num_stages) of that pass instead of the
               tuned choice (tests, tuning sweeps)
  index_fwd_config, index_bwd_config
               (BLOCK_W, num_warps, num_stages) of the index kernels' forward / per-query
               backward (ops/triton_indices.py) instead of the tuned choice
  index_bwd_kv_config
               (rows, num_warps) of the deterministic index backward's per-key kernel
"""
import functools
from typing import NamedTuple, Optional, Tuple

BWD_MODES = ("auto", "two_pass", "one_launch", "atomic_dq")
CONFIG_KINDS = ("fwd", "dkdv", "dq")

Config = Tuple[int, int, int, int]
# Each *_config option: what its tuple holds (its length is the number of names).
CONFIG_FIELDS = {
    "fwd_config": ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
    "dkdv_config": ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
    "dq_config": ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
    "index_fwd_config": ("BLOCK_W", "num_warps", "num_stages"),
    "index_bwd_config": ("BLOCK_W", "num_warps", "num_stages"),
    "index_bwd_kv_config": ("rows", "num_warps"),
}


class KernelOptions(NamedTuple):
    bwd_mode: str = "auto"
    trim_lists: bool = True
    dq_from_ds: bool = True
    fwd_config: Optional[Config] = None
    dkdv_config: Optional[Config] = None
    dq_config: Optional[Config] = None
    index_fwd_config: Optional[Tuple[int, int, int]] = None
    index_bwd_config: Optional[Tuple[int, int, int]] = None
    index_bwd_kv_config: Optional[Tuple[int, int]] = None

    def config(self, kind: str) -> Optional[Config]:
        """The forced (BLOCK_M, BLOCK_N, warps, stages) of pass `kind`, or None."""
        return getattr(self, f"{kind}_config")


DEFAULT = KernelOptions()
_SEP = ";"


def from_dict(options: Optional[dict]) -> KernelOptions:
    """Validated KernelOptions from a user's dict (None or {} -> the defaults)."""
    if not options:
        return DEFAULT
    if not isinstance(options, dict):
        raise TypeError(f"kernel_options: must be a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(KernelOptions._fields))
    if unknown:
        raise ValueError(f"kernel_options: unknown option(s) {unknown}; known: "
                         f"{list(KernelOptions._fields)}")
    values = {}
    for name, value in options.items():
        if name == "bwd_mode":
            if value not in BWD_MODES:
                raise ValueError(f"kernel_options: bwd_mode {value!r} not one of {BWD_MODES}")
        elif name in ("trim_lists", "dq_from_ds"):
            if not isinstance(value, bool):
                raise TypeError(f"kernel_options: {name} must be a bool, got {value!r}")
        elif value is not None:
            fields = CONFIG_FIELDS[name]
            value = tuple(value)
            if len(value) != len(fields) or not all(isinstance(x, int) and x > 0 for x in value):
                raise ValueError(f"kernel_options: {name} must be {len(fields)} positive ints "
                                 f"({', '.join(fields)}), got {value!r}")
        values[name] = value
    return KernelOptions(**values)


def encode(backend: str, options: KernelOptions) -> str:
    """The op's `backend` argument: the backend name, then the options that differ from
    the defaults, in field order."""
    parts = [backend]
    for name, value in zip(KernelOptions._fields, options):
        if value == getattr(DEFAULT, name):
            continue
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, tuple):
            value = ",".join(map(str, value))
        parts.append(f"{name}={value}")
    return _SEP.join(parts)


@functools.lru_cache(maxsize=64)
def _decode_options(text: str) -> KernelOptions:
    values = {}
    for item in text.split(_SEP):
        name, _, value = item.partition("=")
        if name in ("trim_lists", "dq_from_ds"):
            values[name] = value not in ("0", "False", "false")
        elif name.endswith("_config"):
            values[name] = tuple(int(x) for x in value.split(","))
        else:
            values[name] = value
    return from_dict(values)


def decode(backend: str) -> Tuple[str, KernelOptions]:
    """(backend name, options) from the op's `backend` argument."""
    name, sep, rest = backend.partition(_SEP)
    return (name, _decode_options(rest)) if sep else (name, DEFAULT)
