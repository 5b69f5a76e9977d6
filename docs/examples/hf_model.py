"""A Hugging Face model with attn_implementation="flexsparse".

A tiny random-weight Mistral (sliding window 8, GQA) made from its config (no download),
run three ways against attn_implementation="eager" with the same weights:
- a left-padded batch: logits of the real tokens;
- greedy generate() with the KV cache (prefill, then one-query decode steps);
- packed sequences (position_ids restart at each document) in a training step: the loss
  and every parameter's gradient.
flexsparse recognizes transformers' masks (sliding window, padding, packed documents) as
O(N) masks; `fs_hf.STATS` counts how each mask was served.

    pip install -e ".[transformers]"
    python docs/examples/hf_model.py
"""
import torch
import transformers
from transformers import AutoModelForCausalLM

from flexsparse.integrations import transformers as fs_hf
from flexsparse.integrations.transformers import NAME

fs_hf.register()                     # adds "flexsparse" to transformers' registries
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def config():       # a fresh config per model: a shared one would carry one attn_implementation
    return transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=101, sliding_window=8)


eager = AutoModelForCausalLM.from_config(config(), attn_implementation="eager").to(dev).eval()
ours = AutoModelForCausalLM.from_config(config(), attn_implementation="flexsparse").to(dev).eval()
assert (eager.config._attn_implementation, ours.config._attn_implementation) == ("eager", NAME)
ours.load_state_dict(eager.state_dict())
tol = dict(atol=1e-4, rtol=1e-4) if dev == "cpu" else dict(atol=3e-3, rtol=3e-3)   # TF32 on GPUs

# 1. a left-padded batch
ids = torch.randint(0, 101, (2, 20), device=dev)
am = torch.ones(2, 20, dtype=torch.long, device=dev)
am[1, :6] = 0
with torch.no_grad():
    a, b = eager(ids, attention_mask=am).logits, ours(ids, attention_mask=am).logits
torch.testing.assert_close(b[am.bool()], a[am.bool()], **tol)
print("left-padded batch: logits match eager")

# 2. greedy generation with the KV cache
with torch.no_grad():
    ga = eager.generate(ids, attention_mask=am, max_new_tokens=12, do_sample=False)
    gb = ours.generate(ids, attention_mask=am, max_new_tokens=12, do_sample=False)
assert torch.equal(ga, gb), (ga, gb)
print(f"generate: the same {gb.shape[1] - ids.shape[1]} new tokens as eager: {gb[:, 20:].tolist()}")

# 3. packed sequences in a training step
pos = torch.cat([torch.arange(7), torch.arange(9), torch.arange(4)])[None].to(dev)
grads = []
for m in (eager, ours):
    m.train()
    loss = m(ids[:1], position_ids=pos, labels=ids[:1], use_cache=False).loss
    loss.backward()
    grads.append({n: p.grad for n, p in m.named_parameters()})
    print(f"packed documents {[7, 9, 4]}: {m.config._attn_implementation} loss {loss.item():.6f}")
for n in grads[0]:
    torch.testing.assert_close(grads[1][n], grads[0][n], msg=n,
                               **(dict(atol=1e-4, rtol=1e-3) if dev == "cpu" else tol))
print("packed training step: gradients of all parameters match eager")
print(f"masks served: {fs_hf.STATS}")
assert fs_hf.STATS["generic"] == 0
print(f"OK hf_model on {dev}: padding, generate and packed training match eager")
