"""The target wrapper on tiny random models of every supported architecture."""

from __future__ import annotations

import pytest
import torch

from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.target import Target, TargetIdentity, load_target, tokenizer_fingerprint
from specgraft.testing import tiny_model, tiny_tokenizer


def test_forward_matches_plain_model_and_target_is_frozen(tiny_arch):
    model = tiny_model(tiny_arch)
    target = Target(model, tiny_tokenizer())
    n = target.num_layers
    ids = torch.randint(3, 262, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding in the second row
    ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)

    layers = (0, 2, n // 2, n - 1, n)
    out = target(ids, mask, layers=layers)
    assert out.logits.shape == (2, 9, target.vocab_size)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    for i in layers:
        assert out.hidden_states[i].shape == (2, 9, target.hidden_size)
        torch.testing.assert_close(out.hidden_states[i], ref.hidden_states[i], rtol=0, atol=0)

    # Without logits the backbone gives the same hidden states; logits_from_hidden(post-norm) == logits.
    no_logits = target(ids, mask, layers=(n,), logits=False)
    assert no_logits.logits is None
    torch.testing.assert_close(no_logits.hidden_states[n], ref.hidden_states[n])
    torch.testing.assert_close(target.logits_from_hidden(ref.hidden_states[n]), ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target.embed(ids), ref.hidden_states[0])

    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    assert isinstance(target.final_norm, torch.nn.Module)
    assert target.output_head.weight.shape == (target.vocab_size, target.hidden_size)


def test_logits_from_fp32_hidden_states_on_a_bf16_target():
    """An offline feature cache decodes to fp32; a bf16 target's lm_head takes it (as its own dtype's logits)."""
    target = Target(tiny_model("llama").to(torch.bfloat16), tiny_tokenizer())
    ids = torch.randint(3, 262, (2, 9))
    n = target.num_layers
    out = target(ids, layers=(n,))
    assert out.logits.dtype == torch.bfloat16
    torch.testing.assert_close(target.logits_from_hidden(out.hidden_states[n].float()), out.logits, rtol=0, atol=0)


def test_identity_records_target_and_default_eagle3_layers(tiny_arch):
    tok = tiny_tokenizer()
    target = Target(tiny_model(tiny_arch, num_hidden_layers=6), tok, name_or_path=f"tiny/{tiny_arch}")
    ident = target.identity
    assert (ident.hidden_size, ident.vocab_size, ident.num_hidden_layers) == (64, 320, 6)
    assert ident.architecture == type(target.model).__name__
    assert ident.tokenizer_fingerprint == tokenizer_fingerprint(tok) and len(ident.tokenizer_fingerprint) == 16
    assert target.default_eagle3_layers() == (1, 3, 5)  # (2, 3, 3) repeats a layer: spread instead
    assert TargetIdentity.from_dict(ident.to_dict()) == ident


def test_identity_mismatch_names_the_difference():
    made_for = Target(tiny_model("llama"), tiny_tokenizer(), name_or_path="org/a").identity
    other = Target(tiny_model("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
                   tiny_tokenizer(), name_or_path="org/b").identity
    with pytest.raises(TargetMismatchError, match="hidden_size 64 vs 32"):
        made_for.require_compatible(other)
    # A different tokenizer (even with the same sizes) is refused too.
    tok = tiny_tokenizer()
    tok.add_tokens(["extra"])
    retok = Target(tiny_model("llama"), tok, name_or_path="org/a").identity
    with pytest.raises(TargetMismatchError, match="tokenizer"):
        made_for.require_compatible(retok)
    made_for.require_compatible(Target(tiny_model("llama", seed=3), tiny_tokenizer(), name_or_path="copy").identity)


def test_identity_of_a_bare_model_is_the_one_drafters_check():
    tok = tiny_tokenizer()
    target = Target(tiny_model("qwen2"), tok, name_or_path="org/q")
    assert TargetIdentity.of(target) == target.identity  # a Target brings its own tokenizer and name
    assert TargetIdentity.of(target.model, tok, name_or_path="org/q") == target.identity
    assert TargetIdentity.of(target.model).tokenizer_fingerprint is None
    ident = target.identity
    ident.require_same_model(target.model, tok)  # the same model: no error
    ident.require_same_model(target)  # a Target is unwrapped; without a tokenizer it is not compared
    with pytest.raises(TargetMismatchError, match="hidden_size 64 vs 32"):
        ident.require_same_model(tiny_model("qwen2", hidden_size=32, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(TargetMismatchError, match="architecture Qwen2ForCausalLM vs LlamaForCausalLM"):
        ident.require_same_model(tiny_model("llama"))
    other = tiny_tokenizer()
    other.add_tokens(["extra"])
    with pytest.raises(TargetMismatchError, match="tokenizer"):
        ident.require_same_model(target.model, other)


def test_load_target_from_folder_and_bad_paths(tmp_path):
    model, tok = tiny_model("qwen3"), tiny_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    target = load_target(tmp_path / "m")
    assert target.identity.tokenizer_fingerprint == tokenizer_fingerprint(tok)
    assert target.identity.name_or_path == str(tmp_path / "m")
    ids = torch.tensor([[1, 5, 9]])
    torch.testing.assert_close(target(ids).logits, model(ids).logits)

    with pytest.raises(SpecgraftError, match="does not exist"):
        load_target(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecgraftError, match="no config.json"):
        load_target(tmp_path / "empty")


def test_refuses_a_model_that_is_not_a_causal_lm(tmp_path):
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64))
    bert.save_pretrained(tmp_path / "bert")
    with pytest.raises(SpecgraftError, match="not a decoder-only causal LM"):
        load_target(tmp_path / "bert")


def test_layer_index_out_of_range():
    target = Target(tiny_model("llama"))
    with pytest.raises(SpecgraftError, match=r"out of range.*4 layers"):
        target(torch.tensor([[1, 2]]), layers=(5,))
