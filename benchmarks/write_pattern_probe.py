"""How fast HBM takes dbias-sized zero writes in the two shapes a backward can write them.

The CUDA bias backward zeroes dbias where the descriptor lists no block, one CTA per key
block, so each CTA writes a 128-column stripe down the rows: 256-byte pieces 2·Lk bytes
apart (docs/perf-notes.md C50, C53). A row band (128 rows, all columns, one CTA) writes
the same bytes contiguously. This probe times both against torch's memset on a
(B·H, L, L) bf16 tensor, with the same number of programs of the same size, so the only
difference is the address order.

    python -m benchmarks.write_pattern_probe [--length 8192] [--heads 32]
"""
import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _zero_tiles(out_ptr, L: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr, BAND: tl.constexpr,
                STRIPES: tl.constexpr):
    # One program per (head, 128-wide stripe or band); it walks its region tile by tile.
    pid = tl.program_id(0)
    head = pid // (L // BAND)
    which = pid % (L // BAND)
    base = out_ptr + head.to(tl.int64) * L * L
    rows = tl.arange(0, TILE_R)[:, None]
    cols = tl.arange(0, TILE_C)[None, :]
    zeros = tl.zeros((TILE_R, TILE_C), dtype=tl.bfloat16)
    if STRIPES:   # columns [which*BAND, +BAND), all rows, TILE_C == BAND
        for r0 in tl.range(0, L, TILE_R):
            tl.store(base + (r0 + rows).to(tl.int64) * L + which * BAND + cols, zeros)
    else:         # rows [which*BAND, +BAND), all columns
        for c0 in tl.range(0, L, TILE_C):
            for r0 in range(0, BAND, TILE_R):
                tl.store(base + (which * BAND + r0 + rows).to(tl.int64) * L + c0 + cols, zeros)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32, help="B*H")
    a = ap.parse_args()
    L, H, band = a.length, a.heads, 128
    x = torch.empty(H, L, L, dtype=torch.bfloat16, device="cuda")
    gb = x.numel() * 2 / 1e9
    grid = (H * (L // band),)
    runs = {
        "memset (torch zero_)": lambda: x.zero_(),
        "stripes 32x128 tiles (ours)": lambda: _zero_tiles[grid](x, L, 32, 128, band, True),
        "stripes 64x128 tiles": lambda: _zero_tiles[grid](x, L, 64, 128, band, True),
        "bands 32x128 tiles": lambda: _zero_tiles[grid](x, L, 32, 128, band, False),
        "bands 16x256 tiles": lambda: _zero_tiles[grid](x, L, 16, 256, band, False),
        "bands 8x512 tiles": lambda: _zero_tiles[grid](x, L, 8, 512, band, False),
    }
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}; zeros over a "
          f"({H}, {L}, {L}) bf16 tensor, {gb:.2f} GB, {grid[0]} programs of {gb / grid[0] * 1e3:.1f} MB")
    print("| write order | ms | TB/s |\n|---|---|---|")
    for label, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        if label != "memset (torch zero_)":
            assert int(torch.count_nonzero(x)) == 0
        ms = triton.testing.do_bench(fn, warmup=10, rep=100)
        print(f"| {label} | {ms:.3f} | {gb / ms:.2f} |")
        x.fill_(1.0)


if __name__ == "__main__":
    main()
