"""A Hugging Face training step with packed documents, per attention implementation, in one
run: tokens per second of forward + backward (issue 18's benchmark row).

The model is a slice of a ~1B Llama: real width (hidden 2048, 16 query heads and 8 kv heads
of 128, MLP 5632), 2 layers, a small vocabulary (8192) so that the LM head does not hide
the attention. One row of L tokens holds documents of random lengths (position_ids restart
at each), the way packed training batches arrive; transformers turns that into its own
mask per implementation (flexsparse: column ranges; sdpa: a dense bool mask; flex_attention:
a BlockMask).

    python -m benchmarks.bench_hf [--lengths 8192,32768] [--impls sdpa,flexsparse,flex_attention]
        [--steps 5] [--out file.md]
"""
import argparse
import time

import torch


def packed_positions(L, seed, mean=2048):
    """position_ids (1, L) of documents with lengths drawn around `mean`."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < L:
        n = int(torch.randint(mean // 4, 2 * mean, (1,), generator=g))
        n = min(n, L - total)
        lengths.append(n)
        total += n
    return torch.cat([torch.arange(n) for n in lengths])[None], lengths


def make_model(impl, state, transformers):
    cfg = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=8192, max_position_embeddings=131072)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    if state is not None:
        model.load_state_dict(state)
    return model.to("cuda", torch.bfloat16).train()


def step_time(model, ids, pos, steps, warmup=2):
    """Median seconds of one forward + backward, and the last loss."""
    times, loss = [], None
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids, position_ids=pos, labels=ids, use_cache=False)
        out.loss.backward()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        loss = out.loss.item()
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2], loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--impls", default="sdpa,flexsparse,flex_attention")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import transformers

    from flexsparse.integrations import transformers as fs_hf
    fs_hf.register()
    torch.manual_seed(0)
    state = make_model("eager", None, transformers).state_dict()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
             f"{transformers.__version__}, bf16, Llama slice (2 layers, hidden 2048, 16/8 heads "
             f"of 128), one packed row, forward + backward, median of {args.steps} steps",
             "", "| tokens | docs | implementation | ms / step | tokens / s | vs sdpa | loss |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for L in (int(x) for x in args.lengths.split(",")):
        pos, lengths = packed_positions(L, seed=L)
        pos = pos.cuda()
        ids = torch.randint(0, 8192, (1, L), generator=torch.Generator().manual_seed(1)).cuda()
        results = {}
        for impl in args.impls.split(","):
            model = make_model(impl, state, transformers)
            try:
                results[impl] = step_time(model, ids, pos, args.steps)
            except Exception as e:  # noqa: BLE001  (a row that fails is reported, not fatal)
                results[impl] = None
                print(f"| {L} | {len(lengths)} | {impl} | failed: {type(e).__name__}: "
                      f"{str(e)[:120]} | | | |", flush=True)
            del model
            torch.cuda.empty_cache()
            if results[impl] is None:
                continue
            t, loss = results[impl]
            base = results.get("sdpa")
            ratio = f"{base[0] / t:.2f}x" if base else ""
            line = f"| {L} | {len(lengths)} | {impl} | {1e3 * t:.1f} | {L / t:,.0f} | {ratio} | {loss:.4f} |"
            lines.append(line)
            print(line, flush=True)
        # how transformers' masks reached flexsparse (recognized or transformers' dense mask)
        note = f"flexsparse masks at {L}: {dict(fs_hf.STATS)}"
        fs_hf.STATS.update(dict.fromkeys(fs_hf.STATS, 0))
        lines.append(note)
        print(note, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
