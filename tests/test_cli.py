"""`python -m flexsparse demo|env`: what a new user runs first."""
import torch

from flexsparse import __main__ as cli


def test_demo_passes_and_reports_warm_and_first_call_times(capsys):
    assert cli.main(["demo", "--length", "256"]) == 0
    out = capsys.readouterr().out
    assert "fwd+bwd ms (warm)" in out and "first call ms (compile)" in out
    assert "10 passed, 0 failed" in out


def test_env_lists_usable_backends(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    from flexsparse.ops import backends
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"backends registered: {backends.available()}; usable on {device}: " in out
    if device == "cpu":
        # on CPU the Triton kernels run only under the interpreter
        assert "usable on cpu: ['reference']" in out
    else:
        usable = cli.usable_backends(torch.device("cuda"))
        assert f"usable on cuda: {usable}" in out and "reference" in usable


def test_env_says_where_auto_sends_each_mask_kind(capsys, monkeypatch):
    """With the CUDA backend registered (faked here on CPU), `env` says what "auto" takes
    for block masks and for index masks, and where index gradients go, from the same
    tables that route the calls (ops/cuda_backend.py)."""
    from flexsparse.ops import cuda_backend
    monkeypatch.setattr(cli.backends, "available", lambda: ["triton", "reference", "cuda"])
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert '"auto" takes cuda for: block masks' in out
    dims = "/".join(map(str, cuda_backend.AUTO_INDEX_HEAD_DIMS))
    assert f'"auto" takes cuda for index masks at hd {dims}' in out
    for d, g in cuda_backend.INDEX_BWD_OVER_ATOMIC:
        assert f"hd {d} with {g} query heads per kv head" in out


def test_demo_block_sparse_is_about_half_dense():
    masks = dict(cli._demo_masks(1024, 1, torch.device("cpu")))
    desc = masks["block_sparse(50%)"].compile(1, 1, 1, 1024, 1024, device="cpu")
    assert abs(desc.num_visible(1) / 1024 ** 2 - 0.5) < 0.01
