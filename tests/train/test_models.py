"""The embedded Llama and the block protocol (`cadence.models.llama`, `.protocol`).

Specification:
- Llama's logits are (B, T, V); grouped-query attention (n_kv_heads < n_heads) is
  multi-head attention whose key/value heads are repeated, each over its group of
  query heads, to the last bit of the logits' rounding;
- it is causal: changing the tokens after position t leaves the logits up to t as
  they were;
- its ``split_stages(n)``, composed, gives the whole model's logits, for every n up to
  its layer count; tied embeddings are refused for n > 1, and so is more stages than
  blocks;
- the protocol: ``cadence_blocks`` as a dotted attribute name or a method gives the
  blocks; a name that is not there, or that gives no modules, is refused naming the
  attribute; a model declaring nothing gives None; TinyGPT declares its blocks;
- the ``transformers`` adapter finds a Llama's decoder layers and returns its logits;
  the trainer's loss takes a model output's ``.logits``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cadence.models._errors import BlockProtocolError
from cadence.models.config import GPTConfig
from cadence.models.gpt import TinyGPT
from cadence.models.llama import Llama, LlamaConfig
from cadence.models.protocol import can_split, model_blocks, split_by_parts, split_model
from tests.train.user_models import Plain

SMALL = dict(vocab_size=40, seq_len=16, dim=32, n_layers=4, n_heads=4, n_kv_heads=2)


def _llama(**over: object) -> Llama:
    torch.manual_seed(0)
    return Llama(**{**SMALL, **over})


def test_logits_shape_and_config() -> None:
    model = _llama()
    out = model(torch.randint(0, 40, (3, 16)))
    assert out.shape == (3, 16, 40)
    assert model.cfg.hidden == 96  # 8/3 x 32 = 85.3, rounded up to a multiple of 32
    assert model.layers[0].attn.wk.weight.shape == (2 * 8, 32)  # 2 kv heads of width 8
    with pytest.raises(ValueError, match="n_kv_heads 3 must divide n_heads 4"):
        LlamaConfig(n_kv_heads=3)
    with pytest.raises(TypeError):
        Llama(n_experts=2)


def test_gqa_is_mha_with_repeated_kv_heads() -> None:
    gqa = _llama(n_kv_heads=2)
    mha = _llama(n_kv_heads=4)
    sd = gqa.state_dict()
    for key, value in list(sd.items()):
        if key.endswith(("attn.wk.weight", "attn.wv.weight")):
            # (2 heads x 8, D) -> each kv head repeated for its 2 query heads
            sd[key] = value.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(sd)
    x = torch.randint(0, 40, (2, 16))
    torch.testing.assert_close(mha(x), gqa(x), rtol=1e-6, atol=1e-6)
    # and the repeat is what makes them equal: the unrepeated tiling is another model
    sd2 = {
        k: (v.view(2, 8, 32).repeat(2, 1, 1).reshape(32, 32) if k in sd and v.shape[0] == 16 else v)
        for k, v in gqa.state_dict().items()
    }
    mha.load_state_dict(sd2)
    assert (mha(x) - gqa(x)).abs().max() > 1e-3


def test_llama_is_causal() -> None:
    model = _llama()
    x = torch.randint(0, 40, (2, 16))
    y = x.clone()
    y[:, 9:] = (y[:, 9:] + 1) % 40
    a, b = model(x), model(y)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.equal(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_split_stages_compose_to_the_whole_model(n: int) -> None:
    model = _llama()
    x = torch.randint(0, 40, (2, 16))
    h = x
    stages = model.split_stages(n)
    assert len(stages) == n
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)
    params = {id(p) for s in stages for p in s.parameters()}
    assert params == {id(p) for p in model.parameters()}


def test_split_refusals() -> None:
    tied = _llama(tie_embeddings=True)
    assert tied.head.weight is tied.embed.weight
    assert len(tied.split_stages(1)) == 1
    with pytest.raises(BlockProtocolError, match="tied embeddings"):
        tied.split_stages(2)
    with pytest.raises(BlockProtocolError, match="4 blocks: it cannot be cut into 5"):
        _llama().split_stages(5)


class _ByMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def cadence_blocks(self) -> list[nn.Module]:
        return [self.a, self.b]


class _Bad(Plain):
    cadence_blocks = "trunk.layers"


class _Empty(Plain):
    def cadence_blocks(self) -> list[nn.Module]:
        return []


def test_the_block_protocol() -> None:
    llama = _llama()
    assert model_blocks(llama) == list(llama.layers) and can_split(llama)
    gpt = TinyGPT(GPTConfig(n_layers=2))
    assert model_blocks(gpt) == list(gpt.blocks)
    m = _ByMethod()
    assert model_blocks(m) == [m.a, m.b] and not can_split(m)
    assert model_blocks(Plain()) is None and not can_split(Plain())
    with pytest.raises(BlockProtocolError, match=r"_Bad.cadence_blocks = 'trunk.layers'"):
        model_blocks(_Bad())
    with pytest.raises(BlockProtocolError, match="non-empty list"):
        model_blocks(_Empty())
    with pytest.raises(BlockProtocolError, match="split_stages"):
        split_model(Plain(), 2)
    with pytest.raises(BlockProtocolError, match="cadence_stage_parts"):
        split_by_parts(_ByMethod(), 1)  # declares no parts: AttributeError is not it
    assert len(split_model(gpt, 2)) == 2  # TinyGPT's own split_stages


def test_the_transformers_adapter_and_loss() -> None:
    pytest.importorskip("transformers")
    from cadence.models.hf import HFCausalLM, hf_causal_lm
    from cadence.train.build import loss_fn
    from tests.train.user_models import raw_hf_llama

    config = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=40,
    )
    torch.manual_seed(0)
    model = hf_causal_lm("LlamaForCausalLM", **config)
    assert isinstance(model, HFCausalLM)
    blocks = model_blocks(model)
    assert blocks is not None and [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    x = torch.randint(0, 40, (2, 8))
    logits = model(x)
    assert logits.shape == (2, 8, 40)
    # a model returning transformers' output object: the loss reads its .logits
    torch.manual_seed(0)
    raw = raw_hf_llama(**config)
    out = raw(input_ids=x)
    assert not isinstance(out, torch.Tensor)
    y = torch.randint(0, 40, (2, 8))
    assert torch.equal(loss_fn(out, y), loss_fn(logits, y))
