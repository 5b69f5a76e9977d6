"""Per-step descriptor builds (issue 16): a new mask from GPU tensors every step, built with
`mask.compile`, against FlexAttention's compiled `create_block_mask` of the same mask, in
one process.

    python -m benchmarks.build_bench [--lengths 8192,131072,1048576] [--no-flex] [--op-only]
                                     [--variants 8589934592] [--graphed] [--back-to-back]

Columns: the build op (`flexsparse::build_document` / `build_prefix_lm`, one C++ call,
flexsparse/build_op.py; what `mask.compile` uses for these kinds when flexsparse._C is
built, "n/a" for the kinds it does not build), the torch builds with the op turned off
(`build_op.use(False)`: the eager static build, and `compiled_build=True`), and Flex.
`--op-only` skips the torch builds and Flex (Flex stays with `--graphed`). `--variants`
adds a build-op column per FLEXSPARSE_CUDA_DEBUG value (8589934592: the fused one-launch
build of documents and prefix-LM instead of the two-kernel one), timed in turns with the
default (three rounds, the median of the rounds' medians for both). `--graphed` adds the build op
captured once in a CUDA graph and replayed (what a build costs in a training step whose
graphs are replayed: the mask's input tensors are the graph's, a loop copies each step's
data into them in place), and whether the replay's descriptor equals an eager build's
after the inputs changed in place. `--back-to-back` adds the build op and Flex timed as a
training loop runs them: builds issued one after another with one sync at the end, the
time per build (host and GPU overlapping, so the larger of the two; median of three
loops).

Each timed call makes a fresh mask object from the step's tensors (no cache can answer)
and compiles it for B=1, H=16, block 128. Times are medians of wall-clock per build with
the GPU drained after each (host time and kernels both count), in microseconds. Also: the
number of host syncs per build (torch.cuda.set_sync_debug_mode "warn" counts).
"""
import argparse
import dataclasses
import statistics
import time
import warnings

import torch

from flexsparse import masks as M
from flexsparse.descriptor import STATIC_MAX_BLOCKS, BlockDescriptor

from .debug_bits import in_turns, with_debug

H, BLOCK = 16, 128


def doc_lengths(L, n=8, device="cuda"):
    lens = torch.full((n,), L // n, device=device)
    lens[-1] += L - int(lens.sum())
    return lens


def cases(L, device="cuda", heads=H):
    """name -> (make: () -> a fresh flexsparse mask holding `device` tensors, FlexAttention
    mask_mod or None)."""
    lens = doc_lengths(L, device=device)
    doc_id = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
    prefix = torch.tensor([L // 4], device=device)
    starts = torch.cumsum(lens, 0) - lens
    # FlashMask column ranges of the document mask: column j hides rows past its document
    ends = torch.repeat_interleave(starts + lens, lens).to(torch.int32)
    cr = ends.view(1, 1, L, 1).contiguous()
    nb = -(-L // BLOCK)
    layout = torch.rand(1, heads, nb, nb, device=device) < 0.2
    layout |= torch.eye(nb, dtype=torch.bool, device=device)

    def document_mod(b, h, q, kv):
        return (doc_id[q] == doc_id[kv]) & (q >= kv)

    def prefix_mod(b, h, q, kv):
        return (kv < prefix[0]) | (q >= kv)

    def reading(make, tensor):
        make.input = tensor   # the tensor a mask from make() is built from (graph_input)
        return make

    return {
        "document(lengths tensor)": (reading(lambda: M.document(lens), lens), document_mod),
        "prefix_lm(tensor)": (reading(lambda: M.prefix_lm(prefix), prefix), prefix_mod),
        "column_ranges(tensor)": (reading(lambda: M.column_ranges(cr, causal=True), cr), document_mod),
        "block_sparse(layout)": (reading(lambda: M.block_sparse(layout, BLOCK), layout), None),
    }


def graph_input(name, make, L):
    """(the tensor a mask of case `name` is made from, other valid data for it). The tensor
    is a graph's input: the constructor's copy of it is captured with the build. The other
    data: document lengths moved between two documents, a prefix of L / 2, column ranges
    of a shifted document grid, a layout with the diagonal and another random 20%."""
    t = make.input
    if name.startswith("document"):
        new = t.clone()
        new[0] += new[1] // 2
        new[1] -= new[1] // 2
    elif name.startswith("prefix"):
        new = torch.full_like(t, L // 2)
    elif name.startswith("column"):
        new = torch.roll(t, 64, dims=2).clamp_min(torch.arange(L, device=t.device).view(1, 1, L, 1) + 1)
    else:
        new = (torch.rand(t.shape, device=t.device) < 0.2) | torch.eye(t.shape[-1], dtype=torch.bool,
                                                                     device=t.device)
    return t, new.to(t.dtype)


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


def back_to_back_us(fn, reps):
    """µs per call of fn() issued reps times in a row with one sync at the end (the median of
    three such loops): what a build adds to a step whose GPU work follows on the stream."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(loops)


def turns(fn, variants, reps):
    """Median µs of fn() by default and under each FLEXSPARSE_CUDA_DEBUG value in
    `variants`, the settings taking turns three times (with no variants: one timing)."""
    default, *var_times = in_turns(lambda: time_us(fn, reps), variants, 3 if variants else 1)
    return default, var_times


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
    # the sync warnings say "called a synchronizing CUDA operation"; the first call of
    # set_sync_debug_mode also warns that the mode "does not yet detect all synchronizing
    # operations" (once per process), which is not a sync
    return sum("called a synchronizing" in str(w.message) for w in caught)


def kernels_per_call(fn):
    """CUDA kernels (and memsets/copies) one call launches, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def same_descriptor(a, b):
    """Whether two descriptors hold equal tensors (and the same other fields)."""
    for f in dataclasses.fields(BlockDescriptor):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def graphed(build, inp, new_data):
    """build() captured once in a CUDA graph: (replay, check), where replay() runs the graph
    and check() copies new_data into the graph's input tensor, replays, and says whether
    the graph's descriptor equals an eager build from the changed input (restoring it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):   # warm-up off the capture (allocator, lazy state)
            build()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        desc = build()

    def check():
        old = inp.clone()
        inp.copy_(new_data)
        graph.replay()
        ok = same_descriptor(desc, build())
        inp.copy_(old)
        return ok
    return graph.replay, check


OP_KINDS = ("document(lengths tensor)", "prefix_lm(tensor)", "column_ranges(tensor)",
            "block_sparse(layout)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,131072,1048576")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--op-only", action="store_true")
    ap.add_argument("--variants", default="", help="FLEXSPARSE_CUDA_DEBUG values, comma-separated")
    ap.add_argument("--graphed", action="store_true", help="also the build op replayed from a CUDA graph")
    ap.add_argument("--back-to-back", action="store_true",
                    help="also the build op and Flex timed back to back (one sync per loop)")
    a = ap.parse_args()
    variants = [int(x) for x in a.variants.split(",") if x]
    from flexsparse import build_op
    from torch.nn.attention.flex_attention import create_block_mask
    cbm = torch.compile(create_block_mask)
    have_op = build_op.available("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; per build, µs (median); "
          f"build op {'built' if have_op else 'NOT built (flexsparse._C missing)'}")
    print("| mask | L | build op µs | host syncs | GPU kernels | static build (eager) µs "
          "| host syncs | compiled_build µs | host syncs | Flex compiled create_block_mask µs "
          "| Flex / build op |" + "".join(f" build op µs, debug {v} | GPU kernels |" for v in variants)
          + (" build op in a CUDA graph, replay µs | replay == eager build |" if a.graphed else "")
          + (" build op back to back µs | Flex back to back µs |" if a.back_to_back else ""))
    print("|---" * (11 + 2 * len(variants) + 2 * a.graphed + 2 * a.back_to_back) + "|")
    for L in map(int, a.lengths.split(",")):
        for name, (make, mod) in cases(L).items():
            if a.op_only and name not in OP_KINDS:
                continue
            reps = 50 if L <= 131072 else 10
            kw = dict(device="cuda", block_size=BLOCK)
            build = lambda: make().compile(1, H, H, L, L, **kw)  # noqa: E731
            op, op_syncs, op_kernels = float("nan"), "n/a", "n/a"
            var_cols = [(float("nan"), "n/a")] * len(variants)
            nb = -(-L // BLOCK)
            # column ranges and layouts past STATIC_MAX_BLOCKS keep the compact build
            # (padded lists)
            padded = name.startswith("column") or name.startswith("block_sparse")
            if have_op and name in OP_KINDS and not (padded and nb * nb > STATIC_MAX_BLOCKS):
                try:
                    with build_op.use(None):
                        op, var_times = turns(build, variants, reps)
                        op_syncs = host_syncs(build)
                        op_kernels = kernels_per_call(build)
                        var_cols = [(t, with_debug(v, lambda: kernels_per_call(build)))
                                    for v, t in zip(variants, var_times)]
                except Exception as err:
                    print(f"# build op {name} {L}: {type(err).__name__}: {str(err)[:200]}")
            replay_us, replay_ok = float("nan"), "n/a"
            if a.graphed and op == op:
                try:
                    with build_op.use(None):
                        replay, check = graphed(build, *graph_input(name, make, L))
                        replay_us = time_us(replay, reps)
                        replay_ok = "yes" if check() else "NO"
                except Exception as err:
                    print(f"# graphed build {name} {L}: {type(err).__name__}: {str(err)[:200]}")
            b2b, flex_b2b = float("nan"), float("nan")
            if a.back_to_back and op == op:
                with build_op.use(None):
                    b2b = back_to_back_us(build, reps)
            ours, syncs, comp, csyncs, flex = float("nan"), "n/a", float("nan"), "n/a", float("nan")
            if not a.op_only:
                with build_op.use(False):
                    try:
                        ours = time_us(build, reps)
                        syncs = host_syncs(build)
                    except Exception as err:
                        print(f"# static build {name} {L}: {type(err).__name__}: {str(err)[:200]}")
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
                        torch.cuda.empty_cache()
            if mod is not None and not a.no_flex and (not a.op_only or a.graphed or a.back_to_back):
                try:
                    flex_build = lambda: cbm(mod, None, None, L, L, device="cuda", BLOCK_SIZE=BLOCK)  # noqa: E731
                    flex = time_us(flex_build, reps)
                    if a.back_to_back:
                        flex_b2b = back_to_back_us(flex_build, reps)
                except Exception as err:
                    print(f"# flex {name} {L}: {type(err).__name__}: {str(err)[:200]}")
            ratio = f"{flex / op:.1f}x" if flex == flex and op == op else "n/a"
            print(f"| {name} | {L} | {op:.0f} | {op_syncs} | {op_kernels} | {ours:.0f} | {syncs} "
                  f"| {comp:.0f} | {csyncs} | {flex:.0f} | {ratio} |"
                  + "".join(f" {t:.0f} | {k} |" for t, k in var_cols)
                  + (f" {replay_us:.0f} | {replay_ok} |" if a.graphed else "")
                  + (f" {b2b:.0f} | {flex_b2b:.0f} |" if a.back_to_back else ""), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
