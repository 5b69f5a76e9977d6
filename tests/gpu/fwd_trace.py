"""The CUDA forward's timeline, tile by tile, from a build with -DFLEXSPARSE_FWD_TRACE
(tests/gpu.sh trace builds one in a copy of the tree): one thread of each consumer
warpgroup and the producer stamp the SM clock at fixed points of each key tile of two
consecutive work tiles and at their edges, in CTAs 0, 1 and gridDim/2; the host copies the
stamps out after each launch and the op flexsparse::fwd_trace returns them (csrc/fwd_sm90.cuh,
FWD_TRACE, FWD_TRACE_EDGE; the kernel does not print: a printf made ptxas serialize its
wgmmas).

    PYTHONPATH=<trace build> python3 tests/gpu/fwd_trace.py full@8192@128 full@8192@64 ...

Per row it prints the median cycles of each phase of the overlapped loop over the steady
tiles, beside the tensor cores' floor for the same work. Events per consumer tile:
0 top, 1 key tile ready, 2 turn taken (scheduler barrier), 3 QK^T wgmmas issued, 4 P V
wgmmas issued and the turn handed on, 5 S ready, 6 softmax done, 7 P V done. The clock is
calibrated against the global timer over the traced work tile (cycles per ns). Producer: 0 top, 1 key stage free,
2 value stage free, 3 value load issued.
The edge between the two work tiles (EDGE_PHASES, then the next work tile's first key
tile) is printed per warpgroup with its excess: the time from the first work tile's last
key tile to the second one's second key tile, less two steady periods.
"""
import argparse
import os
import statistics
import subprocess
import sys

PHASES = [("top: extras, K wait", 0, 1), ("turn wait", 1, 2), ("QK^T issue", 2, 3),
          ("V wait, PV issue, turn handed on", 3, 4), ("S wait", 4, 5), ("mask + softmax", 5, 6),
          ("P conversion", 6, 7)]


# Edge rows (csrc/fwd_sm90.cuh FWD_TRACE_EDGE): kTraceTiles - 2 for the first traced work
# tile, kTraceTiles - 3 for the second.
TRACE_TILES = 260
EDGE_FIRST, EDGE_SECOND = TRACE_TILES - 2, TRACE_TILES - 3
EDGE_PHASES = [("wait P V(t-1)", 1, 2), ("turn, last P V issued", 2, 3), ("wait last P V", 3, 4),
               ("O / l, lse", 4, 5), ("O store", 5, 6)]


def run_one(row, work_tile, plain=False):
    import torch
    import flexsparse
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from benchmarks import bench
    assert plain or "trace" in os.path.dirname(flexsparse.__file__), flexsparse.__file__
    [(kind, L, D)] = bench.parse_rows(row)
    dev = torch.device("cuda")
    B, H = max(1, bench.TOKENS // L), bench.H
    q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=bench.DTYPE) for _ in range(3))
    fs_mask = bench.make_case(kind, B, L, device=dev)[0]
    desc = fs_mask.compile(B, H, H, L, L, device=dev)
    for rep in range(2):      # the second launch is the one read (the first warms up)
        flexsparse.attention(q, k, v, desc, backend="cuda")
        torch.cuda.synchronize()
        if rep == 1 and not plain:
            print("\n".join(trace_lines(torch.ops.flexsparse.fwd_trace())))
        print(f"=== launch {rep} done", flush=True)
    # This build's own speed (the stamps cost something; compare with the plain build):
    # the forward kernels' GPU time from the profiler, not the calls' wall time. A trace
    # build's op synchronizes and copies the stamps out after every launch (trace_fetch),
    # so back-to-back calls leave the GPU idle between kernels; events around a loop of
    # calls counted that idle time too (2.3x the plain time on sliding 256 hd64, 46th
    # session, where the kernel itself was not measured).
    from benchmarks.kernel_split import per_kernel
    rows = per_kernel(lambda: flexsparse.attention(q, k, v, desc, backend="cuda"), reps=5, warmup=1)
    ms = sum(t for name, t, _ in rows if "fwd_kernel" in name) / 1000
    print(f"TIME {row}: {ms:.4f} ms of forward-kernel GPU time per call in the "
          f"{'plain' if plain else 'trace'} build", flush=True)


def trace_lines(buf):
    """The stamps of the op flexsparse::fwd_trace ((CTA slot, tile, role, event) int32 holding
    uint32 clocks) as lines "FWDTRACE cta role tile e0..e7": per slot its CTA index (role 3,
    last tile, event 4), the key tiles each role stamped, and the calibration row."""
    lines = []
    for slot in buf.long().bitwise_and(0xFFFFFFFF).tolist():
        calibration = slot[TRACE_TILES - 1][3]
        if not any(calibration):
            continue                     # (a slot no CTA recorded)
        cta = calibration[4]
        for role in range(4):
            for t in (range(TRACE_TILES) if role < 3 else [TRACE_TILES - 1]):
                e = slot[t][role]
                if role < 3 and e[0] == 0:
                    continue
                lines.append(f"FWDTRACE {cta} {role} {t} " + " ".join(map(str, e)))
    return lines


def parse(text):
    """{(cta, role): {tile: [8 stamps]}} of the last launch."""
    last = text.split("=== launch 0 done")[-1].split("=== launch 1 done")[0]
    out = {}
    for line in last.splitlines():
        if not line.startswith("FWDTRACE"):
            continue
        cta, role, t, *e = map(int, line.split()[1:])
        if any(e):
            out.setdefault((cta, role), {})[t] = e
    return out


def dt(a, b):
    return (b - a) % (1 << 32)


def row_kind_dim(row):
    """A row's mask kind and head dim: kind@L[@D], D 128 where not given."""
    parts = row.split("@")
    return parts[0], int(parts[2]) if len(parts) >= 3 else 128


def consumer_warpgroups(row, bits):
    """The forward kernel's consumer warpgroups for a row: three for the full mask at hd64
    (the three-warpgroup kernel takes masks whose kv lists are one row for all, unless
    FLEXSPARSE_CUDA_DEBUG bit 134217728), else two. Its key-tile loop keeps one P buffer
    and waits for P V before keeping P: there event 7 holds that wait too."""
    kind, D = row_kind_dim(row)
    return 3 if kind == "full" and D == 64 and not bits & 134217728 else 2


def summarize(row, trace, warpgroups=2):
    D = row_kind_dim(row)[1]
    # the warpgroups' QK^T + PV (64 query rows each) at 4096 flop/clk/SM
    floor = warpgroups * 2 * 64 * 128 * D * 2 // 4096
    lines = [f"### {row}: tensor-core floor per tile ({warpgroups} consumer warpgroups; the first two "
             f"traced) {floor} cycles"]
    for (cta, role), tiles in sorted(trace.items()):
        if role == 3 and TRACE_TILES - 1 in tiles:
            c0, g0, c1, g1 = tiles[TRACE_TILES - 1][:4]
            if g1 != g0:
                lines.append(f"CTA {cta}: clock {dt(c0, c1) / dt(g0, g1):.3f} cycles per ns over the work tile")
    trace = {key: val for key, val in trace.items() if key[1] != 3}
    edges = {key: {t: val.pop(t) for t in (EDGE_FIRST, EDGE_SECOND) if t in val} for key, val in trace.items()}
    for cta in sorted({c for c, _ in trace}):
        lines.append(f"CTA {cta}:")
        for role in (0, 1):
            tiles = trace.get((cta, role), {})
            ts = sorted(tiles)
            second = edges.get((cta, role), {}).get(EDGE_SECOND, [0] * 8)[7] or None   # its first slot
            steady = [t for t in ts if 2 <= t and t + 1 in tiles and t + 2 <= max(ts)
                      and second not in (t + 1, t + 2) and t != second]
            if not steady:
                lines.append(f"  wg{role}: {len(ts)} tiles, too few")
                continue
            med = lambda xs: int(statistics.median(xs)) if xs else -1  # noqa
            period = med([dt(tiles[t][0], tiles[t + 1][0]) for t in steady])
            parts = [f"{name} {med([dt(tiles[t][a], tiles[t][b]) for t in steady])}" for name, a, b in PHASES]
            parts.append(f"next tile, wait for the previous P V, rescale O {med([dt(tiles[t][7], tiles[t + 1][0]) for t in steady])}")
            lines.append(f"  wg{role}: {len(ts)} tiles, period {period} ({floor / max(period, 1):.0%} of floor); "
                         + ", ".join(parts))
        if (cta, 0) in trace and (cta, 1) in trace:
            a, b = trace[(cta, 0)], trace[(cta, 1)]
            common = [t for t in sorted(a) if t in b and t >= 2]
            gap = [dt(a[t][4], b[t][2]) for t in common]   # wg0 hands on -> wg1 turn taken
            gap2 = [dt(b[t][4], a[t + 1][2]) for t in common if t + 1 in a]
            if gap and gap2:
                lines.append(f"  turns: wg0 issued -> wg1 takes turn {int(statistics.median(gap))}, "
                             f"wg1 issued -> wg0 takes next {int(statistics.median(gap2))}")
        lines += edge_lines(cta, trace, edges)
        prod = trace.get((cta, 2), {})
        if prod:
            ts = sorted(prod)[2:-1]
            med = lambda xs: int(statistics.median(xs)) if xs else -1  # noqa
            lines.append(f"  producer: {len(prod)} tiles, wait K stage {med([dt(prod[t][0], prod[t][1]) for t in ts])}, "
                         f"wait V stage {med([dt(prod[t][1], prod[t][2]) for t in ts])}")
            # when K(t) was issued against when wg0 found it ready
            c0 = trace.get((cta, 0), {})
            lead = [dt(prod[t][1], c0[t][1]) for t in ts if t in c0]
            if lead:
                lines.append(f"  K(t) issued -> wg0 sees it ready: median {int(statistics.median(lead))} cycles")
    return "\n".join(lines)


def edge_lines(cta, trace, edges):
    """The edge between the traced work tiles, per consumer warpgroup, in cycles."""
    med = lambda xs: int(statistics.median(xs)) if xs else -1  # noqa
    lines, released = [], []
    for role in (0, 1):
        tiles, edge = trace.get((cta, role), {}), edges.get((cta, role), {})
        if EDGE_FIRST not in edge or EDGE_SECOND not in edge:
            continue
        e0, e1 = edge[EDGE_FIRST], edge[EDGE_SECOND]
        s1 = e1[7]
        if not (s1 - 1 in tiles and s1 in tiles and s1 + 1 in tiles):
            lines.append(f"  wg{role} edge: the second work tile has fewer than two key tiles")
            continue
        released.append(e0[1])
        ts = [t for t in sorted(tiles) if t + 1 in tiles and t + 1 not in (s1, s1 + 1) and t not in (s1 - 1, s1)]
        period = med([dt(tiles[t][0], tiles[t + 1][0]) for t in ts[1:]])
        last, first = tiles[s1 - 1], tiles[s1]
        parts = [f"last softmax -> finish {dt(last[7], e0[1])}"]
        parts += [f"{name} {dt(e0[a], e0[b])}" for name, a, b in EDGE_PHASES]
        parts += [f"-> next queries ready {dt(e0[6], e1[0])}", f"extras, K wait, turn {dt(e1[0], first[2])}",
                  f"first QK^T issue {dt(first[2], first[3])}", f"first S wait {dt(first[4], first[5])}",
                  f"first softmax + P {dt(first[5], first[7])}"]
        span = dt(last[0], tiles[s1 + 1][0])
        lines.append(f"  wg{role} edge (work tiles of {s1} and {max(tiles) - s1 + 1} key tiles): "
                     f"{span} cycles over two key tiles against a steady period {period}: "
                     f"excess {span - 2 * period}; " + ", ".join(parts))
    prod = edges.get((cta, 2), {}).get(EDGE_SECOND)
    if prod and released:
        c0 = edges.get((cta, 0), {}).get(EDGE_SECOND)
        lines.append(f"  producer at the edge: last release_q -> query buffer free {dt(max(released), prod[1])}, "
                     f"wait -> query load issued {dt(prod[1], prod[2])}"
                     + (f", issued -> wg0 sees the queries {dt(prod[2], c0[0])}" if c0 else ""))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="*", default=["full@8192@128", "full@8192@64", "causal@16384@128"])
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--work-tile", type=int, default=2, help="which of a CTA's work tiles to trace")
    ap.add_argument("--raw", help="also write the raw stamps to this directory")
    ap.add_argument("--plain-time", action="store_true", help="only time the rows (any build)")
    ap.add_argument("--bits", type=int, default=0,
                    help="FLEXSPARSE_CUDA_DEBUG bits to run with, besides the work tile's "
                         "(bits 16-30); e.g. 2^44 for hd128's two query buffers")
    args = ap.parse_args()
    if args.bits & (0x7fff << 16):
        ap.error(f"--bits: {args.bits} uses bits 16-30, which pick the traced work tile")
    if args.run:
        return run_one(args.run, args.work_tile)
    if args.plain_time:
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = str(args.bits)
        for row in args.rows:
            run_one(row, 0, plain=True)
        return
    env = dict(os.environ, FLEXSPARSE_CUDA_DEBUG=str(args.bits | (args.work_tile << 16)))
    for row in args.rows:
        res = subprocess.run([sys.executable, __file__, "--run", row], env=env, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"### {row}: failed\n{res.stderr[-2000:]}")
            continue
        if args.raw:
            with open(os.path.join(args.raw, f"trace_{row.replace('@', '_')}.txt"), "w") as f:
                f.write(res.stdout)
        print(summarize(row, parse(res.stdout), consumer_warpgroups(row, args.bits)), flush=True)
        print([ln for ln in res.stdout.splitlines() if ln.startswith("TIME")], flush=True)


if __name__ == "__main__":
    main()
