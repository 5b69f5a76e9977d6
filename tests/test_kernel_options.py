"""Per-call kernel options: validated from the user's dict, carried to the backend inside
the op's `backend` string (the op schemas stay as they are), read back unchanged."""
import pytest
import torch

import flexsparse
from flexsparse import masks as M
from flexsparse.ops import kernel_options as ko
from flexsparse.ops import triton_backend


@pytest.mark.parametrize("options", [
    {},
    {"bwd_mode": "two_pass"},
    {"trim_lists": False, "dq_from_ds": False},
    {"fwd_config": (16, 32, 4, 1), "dq_config": [32, 16, 4, 2], "bwd_mode": "atomic_dq"},
    {"index_fwd_config": (32, 4, 2), "index_bwd_config": (16, 4, 1),
     "index_bwd_kv_config": (64, 8)},
])
def test_encode_decode_round_trip(options):
    opts = ko.from_dict(options)
    text = ko.encode("triton", opts)
    assert ko.decode(text) == ("triton", opts)
    if not options:
        assert text == "triton"         # no options: the plain backend name
    # one canonical string: the order the user wrote the keys in does not matter
    assert ko.encode("triton", ko.from_dict(dict(reversed(list(options.items()))))) == text


@pytest.mark.parametrize("options, error", [
    ({"BWD_MODE": "two_pass"}, ValueError),
    ({"bwd_mode": "fast"}, ValueError),
    ({"trim_lists": 0}, TypeError),
    ({"fwd_config": (16, 32, 4)}, ValueError),
    ({"index_fwd_config": (16, 32, 4, 1)}, ValueError),
    ({"index_bwd_kv_config": (64, 0)}, ValueError),
    (["bwd_mode"], TypeError),
])
def test_bad_options_are_refused(options, error):
    with pytest.raises(error, match="kernel_options"):
        ko.from_dict(options)
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(error, match="kernel_options"):
        flexsparse.attention(q, q, q, M.causal(), kernel_options=options)


def test_options_reach_the_triton_backend(monkeypatch):
    seen = []
    real = triton_backend.triton_block.forward

    def spy(*args):
        seen.append(args[-1])
        return real(*args)
    monkeypatch.setattr(triton_backend.triton_block, "forward", spy)
    q = torch.randn(1, 2, 40, 16)
    options = {"bwd_mode": "one_launch", "fwd_config": (16, 16, 4, 1)}
    out = flexsparse.attention(q, q, q, M.causal(), backend="triton", block_size=(32, 32),
                               kernel_options=options)
    ref = flexsparse.attention(q.double(), q.double(), q.double(), M.causal(),
                               backend="reference", kernel_options=options)
    assert seen == [ko.from_dict(options)]
    torch.testing.assert_close(out.double(), ref, atol=3e-4, rtol=1e-3)
