"""Compile the Triton block kernels' launches for sm_90 on the CPU machine (no GPU) and
record a hash of each PTX, so that a refactor meant to leave the machine code alone can be
checked before and after (docs/design.md, "Checking a kernel refactor without a GPU").

    python tests/ptx_compare.py /tmp/before.json                  # in the old tree
    python tests/ptx_compare.py /tmp/after.json --against /tmp/before.json

Each call of a set of masks, dtypes and backward modes is planned as the Triton backend
plans it (forward_plan, backward_plan, on CPU tensors); every launch is specialized by
Triton's own binder and compiled for sm_90. The PTX is compared without the kernel's name,
its parameter names, `.loc` lines, debug-scope labels and debug sections. Exits 1 on any difference.
"""
import argparse
import hashlib
import json
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

sys.path.insert(0, os.getcwd())        # the tree this runs in, not an installed copy
from flexsparse import masks  # noqa: E402
from flexsparse.ops import kernel_options, triton_block_bwd, triton_block_fwd  # noqa: E402
from flexsparse.ops.triton_launch import Slot  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)


def normalized_ptx(ptx, name):
    lines = []
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            break                                   # debug sections come last
        if "\t.loc\t" in line or line.lstrip().startswith(".file"):
            continue
        if re.fullmatch(r"\$L__tmp\d+:", line):     # debug-scope labels (inlined helpers)
            continue
        lines.append(re.sub(r"KERNEL_param_\d+", "P", line.replace(name, "KERNEL")))
    return "\n".join(lines)


def compile_ptx(kernel, args, kwargs, warps, stages):
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    bound, spec, opts = binder(*args, **kwargs)
    kw = dict(kwargs, num_warps=warps, num_stages=stages)
    options, signature, constexprs, attrs = kernel._pack_args(BACKEND, kw, bound, spec, opts)
    compiled = triton.compile(triton.compiler.ASTSource(kernel, signature, constexprs, attrs),
                              target=TARGET, options=options.__dict__)
    return normalized_ptx(compiled.asm["ptx"], compiled.metadata.name)


def resolve(a, tensors):
    if type(a) is Slot:
        return tensors[a.name]
    if isinstance(a, tuple):
        return tuple(resolve(x, tensors) for x in a)
    return a


def cases():
    """(name, q, k, v, bias, mask, softcap, options): hd64 and hd128, GQA, every predicate
    kind, bias and dbias plans, the three backward modes."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float16)  # noqa: E731
    q, k, v = r(1, 2, 384, 64), r(1, 1, 384, 64), r(1, 1, 384, 64)
    q2, k2, v2 = r(1, 4, 320, 128), r(1, 4, 320, 128), r(1, 4, 320, 128)
    yield "causal64", q, k, v, None, masks.causal(), 0.0, {}
    yield "full128", q2, k2, v2, None, masks.full(), 0.0, {}
    yield "document64", q, k, v, None, masks.document(torch.tensor([100, 200, 84])), 0.0, {}
    yield "window128_softcap", q2, k2, v2, None, masks.sliding_window(64), 30.0, {}
    dense = torch.rand(1, 4, 320, 320, generator=g) > 0.3
    yield ("dense_bias128", q2, k2, v2, r(1, 4, 320, 320), masks.dense(dense), 0.0,
           {"bias_grad": True})
    yield ("key_bias128", q2, k2, v2, r(1, 1, 1, 320), masks.causal(), 0.0, {"bias_grad": True})
    layout = torch.rand(1, 2, 3, 3, generator=g) > 0.4
    yield "block_sparse64", q, k, v, None, masks.block_sparse(layout, block_size=128), 0.0, {}
    yield "causal64_atomic_dq", q, k, v, None, masks.causal(), 0.0, {"bwd_mode": "atomic_dq"}
    yield ("causal128_two_pass_det", q2, k2, v2, None, masks.causal(), 0.0,
           {"bwd_mode": "two_pass", "deterministic": True})
    yield ("prefix64_query_bias", q, k, v, r(1, 2, 384, 1), masks.prefix_lm(100), 0.0,
           {"bias_grad": True})


def hashes():
    out = {}
    for name, q, k, v, bias, mask, softcap, opt in cases():
        B, Hq, Lq, _ = q.shape
        mt = mask.compile(B, Hq, k.shape[1], Lq, k.shape[2], device="cpu",
                          block_size=128).mask_tensors()
        options = kernel_options.DEFAULT._replace(bwd_mode=opt.get("bwd_mode", "auto"))
        scale = q.shape[-1] ** -0.5
        fwd = triton_block_fwd.forward_plan(q, k, v, bias, mt, 128, 128, scale, softcap, options)
        bwd = triton_block_bwd.backward_plan(q, None, q, k, v, q, bias, mt, 128, 128, scale,
                                             softcap, opt.get("deterministic", False),
                                             opt.get("bias_grad", False), options)
        lse = torch.empty(q.shape[:3])
        tensors = dict(q=q, k=k, v=v, bias=bias, out=torch.empty_like(q), lse=lse,
                       do=torch.empty_like(q), glse=lse, dq=torch.empty_like(q),
                       dk=torch.empty_like(k), dv=torch.empty_like(v), delta=lse, lse2=lse)
        tensors.update({n: torch.zeros(s, dtype=d) for n, (s, d, _) in bwd.scratch.items()})
        for i, (kernel, grid, args, kwargs, warps, stages) in enumerate(fwd.launches +
                                                                         bwd.launches):
            ptx = compile_ptx(kernel, resolve(args, tensors), kwargs, warps, stages)
            key = f"{name}/{i}/{kernel.__name__}"
            out[key] = hashlib.sha1(ptx.encode()).hexdigest()[:16]
            print(key, out[key], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--against", help="an earlier run's json: report the launches that differ")
    a = ap.parse_args()
    got = hashes()
    with open(a.out, "w") as f:
        json.dump(got, f, indent=1)
    if a.against:
        with open(a.against) as f:
            before = json.load(f)
        differ = sorted(k for k in set(before) | set(got) if before.get(k) != got.get(k))
        print(f"{len(got)} launches, {len(differ)} differ from {a.against}")
        for k in differ:
            print("  differs:", k)
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
