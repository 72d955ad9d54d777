"""The Llama model against Hugging Face's LlamaForCausalLM built from a config (no download)."""
import torch
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM as HFLlama

from nanoexp.model.llama import LlamaForCausalLM, LlamaShape, count_parameters

SHAPE = LlamaShape(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rope_theta=10000.0,
                   rms_norm_eps=1e-5)


def hf_model(shape: LlamaShape) -> HFLlama:
    config = HFConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                      num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
                      num_key_value_heads=shape.num_key_value_heads, vocab_size=shape.vocab_size,
                      max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
                      rms_norm_eps=shape.rms_norm_eps, tie_word_embeddings=shape.tie_word_embeddings,
                      attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    model = HFLlama(config).eval()
    with torch.no_grad():   # HF initialises norms to ones: randomise them so the test sees them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model


def test_hf_weights_give_hf_logits():
    hf = hf_model(SHAPE)
    ours = LlamaForCausalLM(SHAPE).eval()
    ours.load_state_dict(hf.state_dict())   # names map one to one; strict by default
    ids = torch.randint(0, SHAPE.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # float32, same math in a different order: 1e-5 absolute is the bound the issue sets.
        torch.testing.assert_close(ours(input_ids=ids), hf(ids).logits, atol=1e-5, rtol=0)


def test_our_weights_give_same_logits_in_hf():
    ours = LlamaForCausalLM(SHAPE).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    hf = hf_model(SHAPE)
    hf.load_state_dict(ours.state_dict())
    ids = torch.randint(0, SHAPE.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids), atol=1e-5, rtol=0)
    assert count_parameters(SHAPE) == sum(p.numel() for p in hf.parameters())


def test_tied_embeddings_match_hf():
    shape = LlamaShape(**{**SHAPE.__dict__, "tie_word_embeddings": True})
    hf = hf_model(shape)
    ours = LlamaForCausalLM(shape).eval()
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected   # the same tensor as the embedding
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(0, shape.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids), hf(ids).logits, atol=1e-5, rtol=0)
    assert count_parameters(shape) == sum(p.numel() for p in hf.parameters())
