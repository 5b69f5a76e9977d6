"""Long-context scale check on one GPU: descriptor build cost and attention at 128K / 1M,
next to FlexAttention at the same sizes (or its failure).

    python tests/gpu/scale.py --out scale.md [--budget 280] [--skip-flex] [--skip-check]
        [--skip-attention]

Sections (each row says "n/a (reason)" when a piece is missing or fails):
1. Descriptor builds (flexsparse `mask.compile`, eager) for causal, document, sliding
   window, prefix-LM, shared-question, global+sliding at 128K and 1M tokens, block 128:
   median time over repeats (CUDA events around the call, host syncs included), peak
   extra CUDA memory during the build, bytes the descriptor keeps.
2. flexsparse.attention(backend="auto") at 128K (B=1, H=16, D=128, bf16) forward +
   backward for causal, document, sliding window; forward at 1M for a sliding window.
3. FlexAttention at the same sizes: create_block_mask (eager, then torch.compile'd if
   eager fails) and torch.compile(flex_attention) forward (+ backward at 128K).
4. A GPU equivalence check at 4K: flexsparse with the converted BlockMask vs compiled
   flex_attention, outputs and gradients (bf16), for several mask_mods.
A time budget (--budget seconds) skips what is left, reported as such.
"""
import argparse
import math
import statistics
import sys
import time
import traceback

import torch

T0 = time.time()
ROWS = []          # (section, name, size, columns dict)


def fmt_err(err):
    msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"n/a ({type(err).__name__}: {msg[:110]})"


def budget_left(args):
    return args.budget - (time.time() - T0)


def add(section, name, size, **cols):
    ROWS.append((section, name, size, cols))
    print(f"[{section}] {name} {size}: " + ", ".join(f"{k}={v}" for k, v in cols.items()),
          flush=True)


def cuda_time(fn, repeats=5, warmup=1):
    """Median ms (CUDA events) and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), out


def peak_extra(fn):
    """Peak extra CUDA memory (MiB) while fn runs, and its result."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20, out


def _width(index):
    """Row width of a block list: 'W' explicit indices, or 'Rr' ranges."""
    return f"{index.shape[-2]}r" if index.dim() == 5 else str(index.shape[-1])


def descriptor_bytes(d):
    names = ("kv_count", "kv_index", "kv_full_count", "kv_full_index", "q_count", "q_index",
             "q_full_count", "q_full_index", "dense_mask", "col_ranges", "partial_bits_index",
             "partial_bits", "attn_indices")
    return sum(getattr(d, n).numel() * getattr(d, n).element_size()
               for n in names if getattr(d, n) is not None)


# ------------------------------------------------------------------ masks

def doc_lengths(L, seed=0):
    """Documents of 1K..16K tokens summing to L (a typical packed batch)."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], L
    while left > 0:
        n = min(left, int(torch.randint(1024, 16385, (1,), generator=g)))
        out.append(n)
        left -= n
    return out


def flexsparse_masks(L, device, window=4096, n_global=256):
    from flexsparse import masks as M
    lens = doc_lengths(L)
    q_len = 2048
    n_ans = 8
    ans = [(L - q_len) // n_ans] * n_ans
    ans[-1] += L - q_len - sum(ans)
    # global rows (< n_global see every key) and global columns (seen by every query)
    glob = M.global_tokens(n_global)
    return {
        "causal": M.causal(),
        "document": M.document(lens),
        f"sliding({window})": M.sliding_window(window),
        "prefix_lm(2048)": M.prefix_lm(2048),
        "shared_question": M.shared_question(q_len, ans),
        f"global({n_global})+sliding": M.or_(M.sliding_window(window), glob),
    }


def flex_mask_mods(L, device, window=4096):
    lens = torch.tensor(doc_lengths(L), device=device)
    doc_id = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)

    def causal(b, h, q, kv):
        return q >= kv

    def document(b, h, q, kv):
        return (doc_id[q] == doc_id[kv]) & (q >= kv)

    def sliding(b, h, q, kv):
        return (q >= kv) & (q - kv <= window)
    return {"causal": causal, "document": document, f"sliding({window})": sliding}


def visible_pairs(name, L, window=4096):
    """Attended (query, key) pairs of one head, for the FLOP rate."""
    if name == "causal":
        return L * (L + 1) // 2
    if name.startswith("sliding"):
        w = window + 1
        return w * (w + 1) // 2 + (L - w) * w if L > w else L * (L + 1) // 2
    if name == "document":
        return sum(n * (n + 1) // 2 for n in doc_lengths(L))
    raise KeyError(name)


# ------------------------------------------------------------------ sections

def section_builds(args, device):
    for L in (128 * 1024, 1024 * 1024):
        try:
            masks = flexsparse_masks(L, device)
        except Exception as err:  # noqa: BLE001
            add("build", "all", L, time_ms=fmt_err(err))
            continue
        for name, m in masks.items():
            if budget_left(args) < 30:
                add("build", name, L, time_ms="n/a (time budget)")
                continue
            try:
                def compile_(m=m):
                    from flexsparse.masks import clear_cache
                    clear_cache()           # time the build, not the descriptor cache
                    return m.compile(1, 16, 16, L, L, device=device, block_size=(128, 128))
                mem, d = peak_extra(compile_)
                ms, d = cuda_time(compile_, repeats=args.repeats)
                t = time.perf_counter()
                compile_()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t) * 1e3
                add("build", name, L, time_ms=f"{ms:.3f}", wall_ms=f"{wall:.3f}",
                    peak_MiB=f"{mem:.1f}", kept_MiB=f"{descriptor_bytes(d) / 2**20:.1f}",
                    widths=f"kv {_width(d.kv_index)}/{_width(d.kv_full_index)}, "
                           f"q {_width(d.q_index)}/{_width(d.q_full_index)}")
                del d
            except Exception as err:  # noqa: BLE001
                add("build", name, L, time_ms=fmt_err(err))
            torch.cuda.empty_cache()


def run_attention(fn_fwd, q, k, v, backward, repeats):
    def fwd():
        return fn_fwd(q, k, v)

    def fwd_bwd():
        out = fn_fwd(q, k, v)
        out.backward(grad)
        return out
    if backward:
        grad = torch.randn_like(q)
        for t in (q, k, v):
            t.requires_grad_(True)
        fn = fwd_bwd
    else:
        fn = fwd
    ctx = torch.enable_grad() if backward else torch.no_grad()
    with ctx:
        mem, _ = peak_extra(fn)
        ms, _ = cuda_time(fn, repeats=repeats)
    for t in (q, k, v):
        t.grad = None
        t.requires_grad_(False)
    return ms, mem


def make_qkv(L, device, H=16, D=128, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(1, H, L, D, device=device, dtype=dtype, generator=g) for _ in range(3)]


def attention_configs():
    return [(128 * 1024, "causal", True), (128 * 1024, "document", True),
            (128 * 1024, "sliding(4096)", True), (1024 * 1024, "sliding(4096)", False)]


def section_flexsparse(args, device):
    import flexsparse
    for L, name, backward in attention_configs():
        what = "fwd+bwd" if backward else "fwd"
        if budget_left(args) < 40:
            add("flexsparse", f"{name} {what}", L, time_ms="n/a (time budget)")
            continue
        try:
            mask = flexsparse_masks(L, device)[name]
            q, k, v = make_qkv(L, device)
            desc = mask.compile(1, q.shape[1], k.shape[1], L, L, device=device)
            from flexsparse.ops import backends
            mt = desc.mask_tensors()
            be = backends.choose(q, k, v, None, mt)
            ms, mem = run_attention(
                lambda a, b, c: flexsparse.attention(a, b, c, desc, backend="auto"), q, k, v,
                backward, args.repeats_attn)
            visible = visible_pairs(name, L) * q.shape[1]
            flops = 4 * visible * 128 * (3.5 if backward else 1.0)
            add("flexsparse", f"{name} {what}", L, time_ms=f"{ms:.2f}", peak_MiB=f"{mem:.0f}",
                TFLOPs=f"{flops / ms / 1e9:.1f}", backend=be)
            del q, k, v, desc
        except Exception as err:  # noqa: BLE001
            add("flexsparse", f"{name} {what}", L, time_ms=fmt_err(err))
            traceback.print_exc()
        torch.cuda.empty_cache()


def section_flex(args, device):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as err:  # noqa: BLE001
        add("flex", "all", 0, time_ms=fmt_err(err))
        return
    flex_c = torch.compile(flex_attention)
    cbm_c = None
    for L, name, backward in attention_configs():
        what = "fwd+bwd" if backward else "fwd"
        if budget_left(args) < 60:
            add("flex", f"{name} {what}", L, time_ms="n/a (time budget)")
            continue
        mm = flex_mask_mods(L, device)[name]
        bm, build = None, ""
        try:
            mem, bm = peak_extra(lambda: create_block_mask(mm, None, None, L, L, device=device))
            ms, bm = cuda_time(lambda: create_block_mask(mm, None, None, L, L, device=device),
                               repeats=2)
            build = f"eager {ms:.1f} ms, {mem:.0f} MiB"
        except Exception as err:  # noqa: BLE001
            build = "eager " + fmt_err(err)
            bm = None
            torch.cuda.empty_cache()
            try:
                if cbm_c is None:
                    cbm_c = torch.compile(create_block_mask)
                mem, bm = peak_extra(lambda: cbm_c(mm, None, None, L, L, device=device))
                ms, bm = cuda_time(lambda: cbm_c(mm, None, None, L, L, device=device), repeats=2)
                build += f"; compiled {ms:.1f} ms, {mem:.0f} MiB"
            except Exception as err2:  # noqa: BLE001
                build += "; compiled " + fmt_err(err2)
                bm = None
        torch.cuda.empty_cache()
        if bm is None:
            add("flex", f"{name} {what}", L, time_ms="n/a (no BlockMask)", block_mask=build)
            continue
        try:
            q, k, v = make_qkv(L, device)
            ms, mem = run_attention(lambda a, b, c: flex_c(a, b, c, block_mask=bm), q, k, v,
                                    backward, args.repeats_attn)
            add("flex", f"{name} {what}", L, time_ms=f"{ms:.2f}", peak_MiB=f"{mem:.0f}",
                block_mask=build)
            del q, k, v
        except Exception as err:  # noqa: BLE001
            add("flex", f"{name} {what}", L, time_ms=fmt_err(err), block_mask=build)
        del bm
        torch.cuda.empty_cache()


def section_check(args, device):
    """flexsparse(from_block_mask(bm)) vs compiled flex_attention(bm), bf16, fwd + grads."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        import flexsparse
    except Exception as err:  # noqa: BLE001
        add("check", "all", 0, max_abs_diff=fmt_err(err))
        return
    flex_c = torch.compile(flex_attention)
    L, H, D = 4096 + 77, 4, 64
    ids = torch.cumsum((torch.rand(L, device=device) < 0.002).long(), 0)
    mods = {
        "causal": lambda b, h, q, kv: q >= kv,
        "document": lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv),
        "sliding(300), per-head": lambda b, h, q, kv: (q >= kv) & (q - kv <= 300 + 100 * h),
        "checker (partial bits)": lambda b, h, q, kv: ((q // 7 + kv // 5) % 3) != 0,
    }
    for name, mm in mods.items():
        if budget_left(args) < 30:
            add("check", name, L, max_abs_diff="n/a (time budget)")
            continue
        try:
            bm = create_block_mask(mm, 1, H, L, L, device=device)
            g = torch.Generator(device=device).manual_seed(1)
            base = [torch.randn(1, H, L, D, device=device, dtype=torch.bfloat16, generator=g)
                    for _ in range(3)]
            go = torch.randn(1, H, L, D, device=device, dtype=torch.bfloat16, generator=g)
            res = []
            for fn in (lambda a, b, c: flexsparse.attention(a, b, c, bm, backend="auto"),
                       lambda a, b, c: flex_c(a, b, c, block_mask=bm)):
                t = [x.clone().requires_grad_(True) for x in base]
                out = fn(*t)
                out.backward(go)
                res.append([out.detach()] + [x.grad for x in t])
            # float32 reference of the same mask, to put the bf16 differences in scale
            diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(*res)]
            add("check", name, L, max_abs_diff="out {:.3g}, dq {:.3g}, dk {:.3g}, dv {:.3g}"
                .format(*diffs))
        except Exception as err:  # noqa: BLE001
            add("check", name, L, max_abs_diff=fmt_err(err))
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ report

def to_markdown(env):
    lines = [f"# flexsparse scale ({env})", ""]
    sections = []
    for s, *_ in ROWS:
        if s not in sections:
            sections.append(s)
    titles = {"build": "Descriptor build (block 128, eager, B=1, H=16)",
              "flexsparse": "flexsparse.attention (B=1, H=16, D=128, bf16, backend=auto)",
              "flex": "FlexAttention (create_block_mask + torch.compile(flex_attention))",
              "check": "GPU equivalence: flexsparse vs compiled flex_attention (bf16, L=4173)"}
    for s in sections:
        rows = [r for r in ROWS if r[0] == s]
        cols = []
        for r in rows:
            for c in r[3]:
                if c not in cols:
                    cols.append(c)
        lines += [f"## {titles.get(s, s)}", "",
                  "| mask | tokens | " + " | ".join(cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        for _, name, size, c in rows:
            tokens = f"{size // 1024}K" if size and size % 1024 == 0 else str(size)
            lines.append(f"| {name} | {tokens} | " + " | ".join(str(c.get(k, "")) for k in cols)
                         + " |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="scale.md")
    ap.add_argument("--budget", type=float, default=280.0, help="seconds for everything")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--repeats-attn", type=int, default=3)
    ap.add_argument("--skip-flex", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-attention", action="store_true", help="builds only (section 1)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        text = "# flexsparse scale\n\nn/a (no CUDA device)\n"
        open(args.out, "w").write(text)
        print(text)
        return 0
    device = torch.device(args.device)
    env = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    try:
        import triton
        env += f", triton {triton.__version__}"
    except ImportError:
        env += ", no triton"
    try:
        import flexsparse  # noqa: F401
    except Exception as err:  # noqa: BLE001
        add("build", "import flexsparse", 0, time_ms=fmt_err(err))
    else:
        section_builds(args, device)
        if not args.skip_attention:
            section_flexsparse(args, device)
    if not args.skip_flex:
        section_flex(args, device)
    if not args.skip_check:
        section_check(args, device)
    text = to_markdown(env)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
