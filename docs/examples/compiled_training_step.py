"""A compiled training step with packed documents (torch.compile(fullgraph=True, dynamic=True)).

Several documents are packed into each row; a lengths tensor says where they end, and
`masks.document(lengths)` keeps attention inside each document (causal within it) as an
O(N) block descriptor built inside the compiled graph. The step's loss and gradients are
checked against float64 PyTorch attention with the same mask as a dense tensor.

    python docs/examples/compiled_training_step.py
"""
import torch

import flexsparse
from flexsparse import masks

dev = "cuda" if torch.cuda.is_available() else "cpu"       # CPU: the reference backend
dt = torch.bfloat16 if dev == "cuda" else torch.float32
torch.manual_seed(0)
B, H, Hkv, L, D = 2, 4, 2, 64, 32


class Attention(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, heads * self.d, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
        self.o = torch.nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x, lengths, reference=False):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        if reference:
            out = dense_attention(q, k, v, lengths)
        else:       # packed documents, causal inside each
            out = flexsparse.attention(q, k, v, masks.document(lengths))
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


def dense_attention(q, k, v, lengths):
    """float64 PyTorch attention; the mask made here from the lengths, independently."""
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)
    i = torch.arange(q.shape[2], device=q.device)
    dense = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1).double()
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1).double()
    s = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return (s.masked_fill(~dense, float("-inf")).softmax(-1) @ v).to(q.dtype)


model = Attention(H * D, H, Hkv).to(dev, dt)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)


@torch.compile(fullgraph=True, dynamic=True)
def loss_fn(x, target, lengths):
    return torch.nn.functional.mse_loss(model(x, lengths), target)


# document lengths summing to L, the same packing for every row of the batch (per-row
# lengths, a (B, n) tensor, work too: tests/test_compile_checks.py).
for step, lengths in enumerate([torch.tensor([10, 30, 24]), torch.tensor([7, 50, 7])]):
    x = torch.randn(B, L, H * D, device=dev, dtype=dt)
    target = torch.randn_like(x)
    lengths = lengths.to(dev)
    loss = loss_fn(x, target, lengths)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # the same step in eager mode with float64 dense attention
    opt.zero_grad()
    ref = torch.nn.functional.mse_loss(model(x, lengths, reference=True), target)
    ref.backward()
    tol = dict(atol=2e-2, rtol=2e-2) if dt == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(loss, ref, **tol)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, **tol, msg=n)
    opt.step()
    opt.zero_grad()
    print(f"step {step}: documents {lengths.tolist()} loss {loss.item():.5f} "
          f"(float64 dense reference {ref.item():.5f})")

print(f"OK compiled_training_step on {dev}: loss and gradients match the dense reference")
