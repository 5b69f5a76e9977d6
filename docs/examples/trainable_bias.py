"""A trainable additive bias (Flash-DMA style) and its gradient.

Each head learns a bias over relative distances (ALiBi-like, but learned) that is added to
the attention scores inside a causal mask; flexsparse returns the bias's gradient with
the bias's own shape, computed in the kernels (no (L, L) probability matrix is kept).
The layer's output and the gradients of q, k, v and the bias parameters are checked
against float64 PyTorch attention, then a few optimizer steps fit the bias.

    python docs/examples/trainable_bias.py
"""
import torch

import flexsparse
from flexsparse import masks

dev = "cuda" if torch.cuda.is_available() else "cpu"       # CPU: the reference backend
dt = torch.bfloat16 if dev == "cuda" else torch.float32
torch.manual_seed(0)
B, H, L, D = 2, 4, 96, 32


class RelativeBias(torch.nn.Module):
    """bias[h, i, j] = table[h, clamp(i - j, 0, max_dist)]: (1, H, L, L), differentiable."""

    def __init__(self, heads, max_dist=64):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(heads, max_dist + 1))
        self.max_dist = max_dist

    def forward(self, L):
        i = torch.arange(L, device=self.table.device)
        dist = (i[:, None] - i[None, :]).clamp(0, self.max_dist)
        return self.table[:, dist][None]


def reference(q, k, v, bias):               # float64, causal, + bias
    s = (q.double() @ k.double().transpose(-1, -2)) / D ** 0.5 + bias.double()
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~causal, float("-inf")).softmax(-1) @ v.double()


rel = RelativeBias(H).to(dev)
with torch.no_grad():
    rel.table.copy_(torch.randn_like(rel.table))
q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
dout = torch.randn(B, H, L, D, device=dev, dtype=dt)

grads = []
for attend in ("flexsparse", "reference"):
    for t in (q, k, v, rel.table):
        t.grad = None
    bias = rel(L).to(dt)
    bias.retain_grad()
    if attend == "flexsparse":
        out = flexsparse.attention(q, k, v, masks.causal(), bias=bias)
    else:
        out = reference(q, k, v, bias)
    out.backward(dout.to(out.dtype))
    grads.append([out.detach().to(dt), q.grad, k.grad, v.grad, bias.grad, rel.table.grad])
tol = dict(atol=5e-2, rtol=5e-2) if dt == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
for name, got, want in zip(["out", "dq", "dk", "dv", "dbias", "dtable"], *grads):
    torch.testing.assert_close(got.float(), want.float(), **tol, msg=name)
print(f"dbias: shape {tuple(grads[0][4].shape)} (the bias's own), |dbias| "
      f"{grads[0][4].float().norm().item():.4f}; out, dq, dk, dv, dbias and the table's "
      f"gradient match float64 attention")

# learn the bias: fit a target made with a hidden distance table (sharp locality)
hidden = RelativeBias(H).to(dev)
with torch.no_grad():
    hidden.table.copy_(-0.5 * torch.arange(hidden.max_dist + 1.0, device=dev).expand(H, -1))
    target = flexsparse.attention(q, k, v, masks.causal(), bias=hidden(L).to(dt))
opt = torch.optim.Adam(rel.parameters(), lr=0.1)
losses = []
for step in range(30):
    out = flexsparse.attention(q.detach(), k.detach(), v.detach(), masks.causal(),
                               bias=rel(L).to(dt))
    loss = torch.nn.functional.mse_loss(out.float(), target.float())
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(f"fitting the bias: loss {losses[0]:.5f} -> {losses[-1]:.5f} in {len(losses)} Adam steps")
assert losses[-1] < 0.5 * losses[0], losses
print(f"OK trainable_bias on {dev}: bias gradient matches float64 and the bias trains")
