"""attn_implementation="flexsparse" in Hugging Face transformers (issue 18): tiny random
models made from configs (no downloads), against attn_implementation="eager", on CPU
(flexsparse's reference backend)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from flexsparse import masks as flexsparse_masks  # noqa: E402
from flexsparse.integrations import transformers as fs_hf  # noqa: E402

fs_hf.register()
fs_hf.CHECK = True      # every recognized mask below is compared with transformers' dense one

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=101, max_position_embeddings=256)


def _config(name):
    if name == "llama":
        return transformers.LlamaConfig(**SMALL)
    if name == "mistral":       # sliding window shorter than the sequence
        return transformers.MistralConfig(**SMALL, sliding_window=6)
    if name == "qwen2":
        return transformers.Qwen2Config(**SMALL)
    if name == "gemma2":        # logit softcapping, alternating sliding layers
        return transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=6,
                                         attn_logit_softcapping=20.0)
    if name == "llama4":        # chunked attention (and a full layer without RoPE)
        return transformers.Llama4TextConfig(**SMALL, attention_chunk_size=4,
                                             no_rope_layers=[1, 0], moe_layers=[])
    raise ValueError(name)


def _pair(name):
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(_config(name), attn_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_config(_config(name), attn_implementation="flexsparse").eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


MODELS = ["llama", "mistral", "qwen2", "gemma2"]


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_eager_with_left_padding(name):
    eager, ours = _pair(name)
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 17, dtype=torch.long)
    am[1, :5] = 0
    with torch.no_grad():
        for kw in ({}, {"attention_mask": am}):
            a, b = eager(ids, **kw).logits, ours(ids, **kw).logits
            keep = am.bool() if kw else torch.ones_like(am, dtype=torch.bool)
            torch.testing.assert_close(b[keep], a[keep], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate_with_kv_cache_matches_eager(name):
    """Prefill, then decode steps of one query against the cache (bottom-right causal)."""
    eager, ours = _pair(name)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    am = torch.ones(2, 9, dtype=torch.long)
    am[0, :3] = 0
    with torch.no_grad():
        a = eager.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False)
        b = ours.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_packed_sequences_from_position_ids():
    """Two documents packed in one row (position_ids restart): each sees only itself."""
    eager, ours = _pair("llama")
    ids = torch.randint(0, 101, (1, 14), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
    with torch.no_grad():
        a = eager(ids, position_ids=pos, use_cache=False).logits
        b = ours(ids, position_ids=pos, use_cache=False).logits
        alone = ours(ids[:, 6:], position_ids=pos[:, 6:], use_cache=False).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    # the second document does not see the first
    torch.testing.assert_close(b[:, 6:], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_training_step_gradients_match_eager(name):
    eager, ours = _pair(name)
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(4))
    for m in (eager, ours):
        m.train()
        m(ids, labels=ids).loss.backward()
    for (n, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-3, msg=n)


def test_compiled_model_matches_eager():
    eager, ours = _pair("llama")
    compiled = torch.compile(ours)
    ids = torch.randint(0, 101, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, eager(ids).logits, atol=1e-4, rtol=1e-4)


def test_dropout_is_refused():
    _, ours = _pair("llama")
    ours.train()
    ours.config.attention_dropout = 0.1
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="dropout"):
        ours(torch.randint(0, 101, (1, 8)))


# ------------------------------------------------------------------ mask recognition

import transformers.masking_utils as mu  # noqa: E402


def _left_pad(B, L, pads):
    am = torch.ones(B, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        am[b, :p] = False
    return am


def _packed(pos):
    """transformers' own packed-sequence structure from position_ids (B, L)."""
    ids = mu.find_packed_sequence_indices(pos)
    if hasattr(mu, "packed_sequence_compatibility_function"):        # transformers <= 5.23
        return lambda fn: mu.packed_sequence_compatibility_function(fn, pos, ids)
    # 5.24 composes the two pieces inline in create_causal_mask and its siblings
    return lambda fn: mu.and_masks(mu.remap_positions_for_packed_sequence(fn, pos),
                                   mu.packed_sequence_mask_function(ids))


POS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5],
                    [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
CHUNK_PAD = _left_pad(2, 20, [0, 7])
CASES = {
    # name: (mask_function, attention_mask, B, Lq, Lk, q_offset, kv_offset, expected kind)
    "causal": (mu.causal_mask_function, None, 2, 20, 20, 0, 0, "named"),
    "causal_left_pad": (mu.causal_mask_function, _left_pad(2, 20, [0, 6]), 2, 20, 20, 0, 0,
                        "column_ranges"),
    "sliding": (mu.sliding_window_causal_mask_function(5), None, 2, 20, 20, 0, 0, "named"),
    "sliding_left_pad": (mu.sliding_window_causal_mask_function(5), _left_pad(2, 20, [3, 0]),
                         2, 20, 20, 0, 0, "column_ranges"),
    "chunked": (mu.chunked_causal_mask_function(6, torch.zeros(2, dtype=torch.long)), None,
                2, 20, 20, 0, 0, "column_ranges"),
    "chunked_left_pad": (mu.chunked_causal_mask_function(6, torch.tensor([0, 7])), CHUNK_PAD,
                         2, 20, 20, 0, 0, "column_ranges"),
    "bidirectional_pad": (mu.bidirectional_mask_function, _left_pad(2, 20, [0, 4]), 2, 20, 20,
                          0, 0, "column_ranges"),
    "bidirectional_sliding": (mu.sliding_window_bidirectional_mask_function(3), None, 1, 20,
                              20, 0, 0, "named"),
    "packed_causal": (_packed(POS)(mu.causal_mask_function), None, 2, 20, 20, 0, 0,
                      "column_ranges"),
    "packed_sliding": (_packed(POS)(mu.sliding_window_causal_mask_function(4)), None, 2, 20,
                       20, 0, 0, "column_ranges"),
    "packed_chunked": (_packed(POS)(mu.chunked_causal_mask_function(
        4, torch.zeros(2, dtype=torch.long))), None, 2, 20, 20, 0, 0, "column_ranges"),
    # transformers before 5.24: the packed-id mask without the position remap
    "packed_causal_no_remap": (mu.and_masks(mu.causal_mask_function,
                                            mu.packed_sequence_mask_function(
                                                mu.find_packed_sequence_indices(POS))),
                               None, 2, 20, 20, 0, 0, "column_ranges"),
    "packed_sliding_no_remap": (mu.and_masks(mu.sliding_window_causal_mask_function(4),
                                             mu.packed_sequence_mask_function(
                                                 mu.find_packed_sequence_indices(POS))),
                                None, 2, 20, 20, 0, 0, "column_ranges"),
    "packed_chunked_no_remap": (mu.and_masks(mu.chunked_causal_mask_function(
        4, torch.zeros(2, dtype=torch.long)), mu.packed_sequence_mask_function(
            mu.find_packed_sequence_indices(POS))), None, 2, 20, 20, 0, 0, "column_ranges"),
    # KV cache: decode (q_length=1) and a chunked prefill against a dynamic cache
    "decode": (mu.causal_mask_function, None, 2, 1, 21, 20, 0, "named"),
    "decode_left_pad": (mu.causal_mask_function, _left_pad(2, 21, [0, 5]), 2, 1, 21, 20, 0,
                        "column_ranges"),
    "prefill_on_cache": (mu.causal_mask_function, None, 2, 7, 27, 20, 0, "named"),
    # a sliding-window cache (kv_offset > 0) and a static cache (kv_length past the tokens)
    "sliding_cache": (mu.sliding_window_causal_mask_function(6), _left_pad(2, 30, [0, 27]),
                      2, 3, 8, 27, 25, "column_ranges"),
    "static_cache": (mu.causal_mask_function, _left_pad(2, 12, [0, 2]), 2, 3, 32, 9, 0,
                     "column_ranges"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recognized_mask_equals_transformers_mask(case):
    """Self-check: the O(N) flexsparse mask is element for element transformers' own."""
    fn, am, B, Lq, Lk, qo, ko, kind = CASES[case]
    got = fs_hf._recognize(B, Lq, Lk, qo, ko, fn, am, "cpu")
    assert got is not None, case
    m, got_kind = got
    assert got_kind == kind
    want = fs_hf.generic_dense(B, Lq, Lk, qo, ko, fn, am)
    dense = m.to_dense(B, 1, Lq, Lk).expand(B, 1, Lq, Lk)
    if case != "decode":                            # one query sees the whole cache
        assert want.any() and not want.all()        # a real mask, not a trivial one
    assert torch.equal(dense, want), case
    fs_hf.check(m, B, Lq, Lk, qo, ko, fn, am)       # the same check, as CHECK=True runs it


def test_check_catches_a_wrong_mask():
    with pytest.raises(AssertionError, match="differs"):
        fs_hf.check(flexsparse_masks.sliding_window(3), 1, 10, 10, 0, 0, mu.causal_mask_function)


def _custom(b, h, q, kv):
    return (q + kv) % 3 != 0


def _fake_overlay():
    """A function that looks like transformers' sliding overlay but holds other variables
    (a changed transformers): recognition must not trust it."""
    width = 4

    def inner_mask(b, h, q, kv):
        return kv > q - width
    inner_mask.__module__ = "transformers.masking_utils"
    inner_mask.__qualname__ = "sliding_window_overlay.<locals>.inner_mask"
    return inner_mask


FALLBACKS = {
    "or_masks": mu.or_masks(mu.causal_mask_function, _custom),
    "custom": _custom,
    "and_custom": mu.and_masks(mu.causal_mask_function, _custom),
    "blockwise": mu.or_masks(mu.causal_mask_function,
                             mu.blockwise_overlay(torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1, -1, -1]]))),
    "changed_structure": mu.and_masks(mu.causal_mask_function, _fake_overlay()),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_unknown_structure_falls_back_to_transformers_dense_mask(case):
    fn = FALLBACKS[case]
    am = _left_pad(1, 10, [2])
    assert fs_hf.recognize(1, 10, 10, 0, 0, fn, am) is None
    before = dict(fs_hf.STATS)
    got = fs_hf.mask(1, 10, 10, 0, 0, fn, am, allow_is_causal_skip=True)
    assert fs_hf.STATS["generic"] == before["generic"] + 1
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bool
    torch.testing.assert_close(got, fs_hf.generic_dense(1, 10, 10, 0, 0, fn, am))


# ------------------------------------------------------------------ models, recognized masks

def _recognized(fn):
    """Run fn; return how many masks were served named / as column ranges / generic."""
    before = dict(fs_hf.STATS)
    out = fn()
    return out, {k: fs_hf.STATS[k] - before[k] for k in before}


@pytest.mark.parametrize("name", MODELS + ["llama4"])
def test_decode_logits_with_kv_cache_match_eager(name):
    """Left-padded prefill, then decode steps of one query (q_length=1, bottom-right causal)
    against a dynamic cache (sliding layers: a sliding-window cache with kv_offset > 0),
    logits compared at every step; all masks recognized (none generic)."""
    eager, ours = _pair(name)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(6))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :4] = 0
    nxt = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(7))
    def run(m):
        cache = transformers.DynamicCache(config=m.config)
        a, steps = am, []
        o = m(ids, attention_mask=a, past_key_values=cache, use_cache=True)
        steps.append(o.logits[:, -1])
        for t in range(nxt.shape[1]):
            a = torch.cat([a, torch.ones(2, 1, dtype=torch.long)], 1)
            o = m(nxt[:, t:t + 1], attention_mask=a, past_key_values=cache, use_cache=True)
            steps.append(o.logits[:, -1])
        return torch.stack(steps)

    with torch.no_grad():
        ref = run(eager)
        got, counts = _recognized(lambda: run(ours))
    assert counts["generic"] == 0 and counts["column_ranges"] >= 1
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS + ["llama4"])
def test_packed_sequences_logits_and_gradients_match_eager(name):
    """Three documents per row (position_ids restart; the second row's first document starts
    at position 3): logits and every parameter's gradient against eager; the masks are
    recognized as column ranges, and a document alone gives the same logits."""
    eager, ours = _pair(name)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(8))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2],
                        [3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    outs = []
    for m in (eager, ours):
        m.train()
        o, counts = _recognized(lambda: m(ids, position_ids=pos, labels=ids, use_cache=False))
        o.loss.backward()
        outs.append(o.logits.detach())
    assert counts["generic"] == 0 and counts["column_ranges"] >= 1
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    for (n, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-3, msg=n)
    ours.eval()
    with torch.no_grad():
        alone = ours(ids[:1, 5:13], position_ids=pos[:1, 5:13], use_cache=False).logits
    torch.testing.assert_close(outs[1][:1, 5:13], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS + ["llama4"])
def test_left_padded_training_gradients_match_eager(name):
    eager, ours = _pair(name)
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(9))
    am = torch.ones(2, 12, dtype=torch.long)
    am[0, :5] = 0
    labels = ids.masked_fill(am == 0, -100)
    # logits at position t predict labels[t + 1]: the last padding position (whose row sees
    # no key: eager spreads it uniformly, flexsparse gives 0) must not predict a real token
    labels[0, 5] = -100
    for m in (eager, ours):
        m.train()
        _, counts = _recognized(lambda: m(ids, attention_mask=am, labels=labels).loss.backward())
    assert counts["generic"] == 0 and counts["column_ranges"] >= 1
    for (n, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-3, msg=n)


def test_plain_causal_and_sliding_are_named_masks():
    """No padding, no packing: masks.causal() / masks.sliding_window(w - 1), cached."""
    _, ours = _pair("gemma2")
    ids = torch.randint(0, 101, (1, 10), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        _, counts = _recognized(lambda: ours(ids))
    assert counts == {"named": 2, "column_ranges": 0, "generic": 0}
    m = fs_hf.recognize(1, 10, 10, 0, 0, mu.sliding_window_causal_mask_function(6))
    assert repr(m) == "sliding_window(left=5, right=0)"


def test_compiled_model_with_left_padding_matches_eager():
    """Under torch.compile the closures cannot be read: transformers' dense mask is used."""
    eager, ours = _pair("mistral")
    compiled = torch.compile(ours)
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(11))
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, :3] = 0
    with torch.no_grad():
        got, ref = compiled(ids, attention_mask=am).logits, eager(ids, attention_mask=am).logits
    keep = am.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=1e-4)
