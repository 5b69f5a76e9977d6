"""attn_implementation="flexsparse" in Hugging Face transformers (issue 18): tiny random
models made from configs (no downloads), against attn_implementation="eager", on CPU
(flexsparse's reference backend)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from flexsparse.integrations import transformers as fs_hf  # noqa: E402

fs_hf.register()

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


@pytest.mark.parametrize("name", ["llama", "mistral"])
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
