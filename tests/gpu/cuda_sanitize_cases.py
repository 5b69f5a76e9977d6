"""Small calls of the CUDA backend for compute-sanitizer's racecheck and synccheck (too slow
for the test suite under those tools): both forward schedules (FLEXSPARSE_CUDA_DEBUG=32
runs the serial one), head dims 64/128/256 (hd64's three-warpgroup forward too), column
ranges, a dense mask with fully masked rows, bias, odd lengths, GQA, the backward where it
is built (every head dim), the forward's two query buffers (C89; at hd64 with both
epilogues, C111), its band kernels for sliding windows (C113) and the backward's (C114),
its work tiles crossed in the key-tile loop (C91), and the backward's dK / dV by TMA stores
(C116), also from key tiles that no query sees, and the persistent backward (C118, the
default of the bf16 hd128 64-row kernel; bit 2^53 takes one CTA per key tile).
Prints one line per case; the tool's summary says whether any hazard was seen."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_triton_gpu as T  # noqa: E402

import flexsparse  # noqa: E402
from flexsparse import masks as M  # noqa: E402
from flexsparse.ops import cuda_backend  # noqa: E402


def run(name, B, Hq, Hkv, Lq, Lk, D, mask, *, bias=False, backward=True, bias_inf=False):
    torch.manual_seed(len(name))
    dt = torch.bfloat16
    grad = backward and cuda_backend.has_backward()
    q = torch.randn(B, Hq, Lq, D, device="cuda", dtype=dt, requires_grad=grad)
    k = torch.randn(B, Hkv, Lk, D, device="cuda", dtype=dt, requires_grad=grad)
    v = torch.randn(B, Hkv, Lk, D, device="cuda", dtype=dt, requires_grad=grad)
    b = torch.randn(B, Hq, Lq, Lk, device="cuda", dtype=dt) if bias else None
    if bias_inf:   # -inf entries: the forward's redo queue and its second launch
        b[torch.rand(b.shape, device="cuda") < 0.01] = -float("inf")
    if b is not None:
        b.requires_grad_(grad)
    out = flexsparse.attention(q, k, v, mask, bias=b, backend="cuda")
    if grad:
        out.float().square().sum().backward()
    torch.cuda.synchronize()
    print(f"{name}: ok, out finite={bool(torch.isfinite(out).all())}", flush=True)


def main():
    L = 300
    dm = torch.rand(1, 2, L, L, device="cuda") < 0.5
    dm[:, :, 100:200] = False
    cr = torch.randint(0, L + 1, (1, 1, L, 2), device="cuda").sort(-1).values
    cases = [
        ("causal hd128", 1, 2, 1, L, L, 128, M.causal()),
        ("document hd128", 1, 2, 2, 520, 520, 128, M.document([100, 220, 200])),
        ("column ranges hd128", 1, 2, 1, L, L, 128, M.column_ranges(cr, causal=True)),
        ("sliding hd64 gqa", 1, 4, 1, 333, 333, 64, M.sliding_window(90)),
        ("prefix hd64 odd", 1, 2, 2, 129, 517, 64, M.prefix_lm(60)),
        ("causal hd256", 1, 2, 2, 257, 257, 256, M.causal()),
        ("document hd256 gqa", 1, 4, 2, 330, 330, 256, M.document([100, 230])),
        ("dense fully masked rows", 1, 2, 2, L, L, 128, M.dense(dm)),
        # hd64's three-warpgroup forward (192-row work tiles, descriptors of 384-row query
        # blocks): the full mask, and partial tiles
        ("full hd64 three warpgroups gqa", 1, 4, 2, 500, 500, 64,
         M.full().compile(1, 4, 2, 500, 500, device="cuda", block_size=(384, 128))),
        ("causal hd64 three warpgroups", 1, 2, 2, 450, 450, 64,
         M.causal().compile(1, 2, 2, 450, 450, device="cuda", block_size=(384, 128))),
        # ... and over 128-row blocks, the full mask's kv lists being one row for all
        ("full hd64 three warpgroups default blocks", 2, 2, 1, 450, 333, 64, M.full()),
    ]
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""   # name filter
    for schedule in ("0", "32"):
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = schedule
        for c in cases:
            if only in c[0]:
                run(f"[debug {schedule}] {c[0]}", *c[1:])
        if only and "bias" not in only:
            continue
        run(f"[debug {schedule}] bias hd64", 1, 2, 2, 200, 200, 64, M.causal(), bias=True)
        run(f"[debug {schedule}] bias hd256", 1, 2, 2, 200, 200, 256, M.causal(), bias=True)
        # the bias-tile kernels (TMA bias tiles; the backward's dbias zeroed by TMA where no
        # block is listed)
        run(f"[debug {schedule}] bias tiles hd128 document", 1, 2, 1, 520, 520, 128,
            M.document([100, 220, 200]), bias=True)
        # (hd64: two bias buffers in the backward, the heads of a group one after another)
        run(f"[debug {schedule}] bias tiles hd64 document gqa", 1, 4, 2, 520, 520, 64,
            M.document([100, 220, 200]), bias=True)
    if not only or "80-row" in only:
        # hd128's 80-row backward (every list one row for all: the full mask), GQA heads
        # one after another, lengths no step divides; and the 64-row kernel on the same call
        # (bit 268435456)
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "0"
        run("full hd128 80-row backward gqa", 2, 4, 2, 333, 290, 128, M.full())
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "268435456"
        run("[debug 268435456] full hd128 64-row backward gqa", 2, 4, 2, 333, 290, 128, M.full())
    if not only or "bias" in only:
        # (the cases above take the forward's bias tiles; bit 65536: its per-score-load kernel)
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "0"
        run("forward bias -inf entries hd128 (redo queue)", 1, 2, 1, 520, 520, 128,
            M.document([100, 220, 200]), bias=True, bias_inf=True)
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "65536"
        run("[debug 65536] forward bias loads hd128 document", 1, 2, 1, 520, 520, 128,
            M.document([100, 220, 200]), bias=True)
        run("[debug 65536] forward bias loads hd64 causal", 1, 2, 2, 200, 200, 64, M.causal(), bias=True)
    if not only or "query buffers" in only:
        # the forward's two query buffers (bit 17592186044416, C89; hd64's default since
        # C92): over 2 x 132 work tiles, so that the persistent CTAs reuse each buffer
        # (forward only: the backward is the same as above)
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "17592186044416"
        run("[debug 2^44] two query buffers hd64 causal gqa", 1, 8, 2, 4608, 4608, 64, M.causal(),
            backward=False)
        run("[debug 2^44] two query buffers hd128 sliding odd", 1, 8, 8, 4601, 4601, 128,
            M.sliding_window(300), backward=False)
        # and a document whose one-token document makes a work tile of one key tile
        run("[debug 2^44] two query buffers hd128 document odd", 1, 8, 8, 4601, 4601, 128,
            M.document([1000, 1, 2000, 1600]), backward=False)
        # hd64's two query buffers store O through the staging buffer and TMA (C111; the
        # case above runs it too): the staging buffer reused across a CTA's work tiles, rows
        # past Lq clipped by the store; bit 2^50: the register-store epilogue (before C111)
        for bits, epilogue in ((0, "TMA store"), (1 << 50, "register store")):
            os.environ["FLEXSPARSE_CUDA_DEBUG"] = str(bits)
            run(f"[debug {bits and '2^50'}] two query buffers {epilogue} hd64 sliding odd gqa", 1, 8, 2,
                4601, 4601, 64, M.sliding_window(256), backward=False)
    if not only or "band" in only:
        # C113's band kernels (sliding-window descriptors, bf16, forward only; the
        # windows above take them too): odd lengths (tiles crossing Lk), GQA, and Lq != Lk
        # (the band's offset)
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "0"
        for name, Lq, Lk, D, (left, right) in (("sliding odd gqa hd64", 4601, 4601, 64, (255, 0)),
                                                ("lookahead cross hd128", 1500, 2001, 128, (200, 30)),
                                                ("lookahead cross hd64", 2001, 1500, 64, (100, 7))):
            run(f"[debug 0] band {name}", 1, 8, 2, Lq, Lk, D, M.sliding_window(left, right),
                backward=False)
        # C114: the backward's per-key intervals from the window (every kernel that stages
        # ranges otherwise: hd64's 128-row plain one, hd128's general one, hd256's)
        for name, Lq, Lk, D, (left, right) in (("odd gqa hd64", 1001, 1001, 64, (255, 0)),
                                                ("lookahead cross hd128", 1500, 2001, 128, (200, 30)),
                                                ("lookahead cross hd256", 700, 555, 256, (100, 7))):
            run(f"[debug 0] band backward {name}", 1, 4, 2, Lq, Lk, D, M.sliding_window(left, right))
    if not only or "tma epilogue" in only:
        # C116: the backward's dK / dV through the key / value buffers and TMA stores,
        # every backward kernel, lengths no key tile divides, GQA, key tiles with no step
        # (lookahead) (the bias at L = 384: rows TMA can read, so the bias-tile kernel)
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "0"
        for name, Lq, Lk, D, mask, kw in (("causal hd128", 333, 333, 128, M.causal(), {}),
                                          ("full hd128 80-row", 333, 333, 128, M.full(), {}),
                                          ("causal hd64", 333, 333, 64, M.causal(), {}),
                                          ("causal hd256", 333, 333, 256, M.causal(), {}),
                                          ("lookahead hd128", 300, 1000, 128, M.sliding_window(100, 0), {}),
                                          ("bias tiles hd128", 384, 384, 128, M.causal(), {"bias": True})):
            run(f"[debug 0] tma epilogue {name}", 1, 4, 2, Lq, Lk, D, mask, **kw)
    if not only or "persistent" in only:
        # C118 (the default there): the persistent backward, more key tiles than SMs (5 x 4 x 8 = 160),
        # so that CTAs take several and the tile ring, kv_empty and barrier_kv's parity turn
        # over; key tiles with no step (lookahead; with GQA: four end stages per such tile)
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "0"
        for name, B, Hq, Hkv, Lq, Lk, mask in (("causal", 5, 4, 4, 1024, 1024, M.causal()),
                                               ("sliding", 5, 4, 4, 1024, 1024, M.sliding_window(200, 0)),
                                               ("lookahead gqa", 2, 8, 2, 300, 1000, M.sliding_window(100, 0))):
            run(f"[debug 0] persistent {name}", B, Hq, Hkv, Lq, Lk, 128, mask)

if __name__ == "__main__":
    main()
