"""Per-step descriptor builds (issue 16): a new mask from GPU tensors every step, built with
`mask.compile`, against FlexAttention's compiled `create_block_mask` of the same mask, in
one process.

    python -m benchmarks.build_bench [--lengths 8192,131072,1048576] [--no-flex]

Each timed call makes a fresh mask object from the step's tensors (no cache can answer)
and compiles it for B=1, H=16, block 128. Times are medians of wall-clock per build with
the GPU drained after each (host time and kernels both count), in microseconds. Also: the
number of host syncs per build (torch.cuda.set_sync_debug_mode "warn" counts).
"""
import argparse
import statistics
import time
import warnings

import torch

from flexsparse import masks as M

H, BLOCK = 16, 128


def doc_lengths(L, n=8, device="cuda"):
    lens = torch.full((n,), L // n, device=device)
    lens[-1] += L - int(lens.sum())
    return lens


def cases(L):
    """name -> (make: () -> a fresh flexsparse mask, FlexAttention mask_mod or None)."""
    lens = doc_lengths(L)
    doc_id = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), lens)
    prefix = torch.tensor([L // 4], device="cuda")
    starts = torch.cumsum(lens, 0) - lens
    # FlashMask column ranges of the document mask: column j hides rows past its document
    ends = torch.repeat_interleave(starts + lens, lens).to(torch.int32)
    cr = ends.view(1, 1, L, 1).contiguous()
    nb = -(-L // BLOCK)
    layout = torch.rand(1, H, nb, nb, device="cuda") < 0.2
    layout |= torch.eye(nb, dtype=torch.bool, device="cuda")

    def document_mod(b, h, q, kv):
        return (doc_id[q] == doc_id[kv]) & (q >= kv)

    def prefix_mod(b, h, q, kv):
        return (kv < prefix[0]) | (q >= kv)

    return {
        "document(lengths tensor)": (lambda: M.document(lens), document_mod),
        "prefix_lm(tensor)": (lambda: M.prefix_lm(prefix), prefix_mod),
        "column_ranges(tensor)": (lambda: M.column_ranges(cr, causal=True), document_mod),
        "block_sparse(layout)": (lambda: M.block_sparse(layout, BLOCK), None),
    }


def time_us(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def host_syncs(fn):
    """Host syncs during fn(), as torch.cuda.set_sync_debug_mode("warn") reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,131072,1048576")
    ap.add_argument("--no-flex", action="store_true")
    a = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask
    cbm = torch.compile(create_block_mask)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; per build, µs (median)")
    print("| mask | L | flexsparse µs | host syncs | compiled_build µs | host syncs "
          "| Flex compiled create_block_mask µs | Flex / compiled_build |")
    print("|---|---|---|---|---|---|---|---|")
    for L in map(int, a.lengths.split(",")):
        for name, (make, mod) in cases(L).items():
            reps = 50 if L <= 131072 else 10
            kw = dict(device="cuda", block_size=BLOCK)
            try:
                build = lambda: make().compile(1, H, H, L, L, **kw)  # noqa: E731
                ours = time_us(build, reps)
                syncs = host_syncs(build)
            except Exception as err:
                print(f"| {name} | {L} | failed: {type(err).__name__}: {str(err)[:150]} |")
                continue
            try:
                cbuild = lambda: make().compile(1, H, H, L, L, compiled_build=True, **kw)  # noqa: E731
                t0 = time.perf_counter()
                cbuild()
                first = time.perf_counter() - t0
                comp = time_us(cbuild, reps)
                csyncs = host_syncs(cbuild)
                print(f"# {name} {L}: first compiled build {first:.1f} s")
            except Exception as err:
                print(f"# compiled_build {name} {L}: {type(err).__name__}: {str(err)[:200]}")
                comp, csyncs = float("nan"), "n/a"
                torch.cuda.empty_cache()
            flex = float("nan")
            if mod is not None and not a.no_flex:
                try:
                    flex = time_us(lambda: cbm(mod, None, None, L, L, device="cuda",
                                               BLOCK_SIZE=BLOCK), reps)
                except Exception as err:
                    print(f"# flex {name} {L}: {type(err).__name__}: {str(err)[:200]}")
            ratio = f"{flex / comp:.1f}x" if flex == flex and comp == comp else "n/a"
            print(f"| {name} | {L} | {ours:.0f} | {syncs} | {comp:.0f} | {csyncs} | {flex:.0f} "
                  f"| {ratio} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
