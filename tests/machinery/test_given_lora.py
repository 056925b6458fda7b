"""Lesson 19's given code that no exercise test calls (minitorch.lora): putting adapters into a model and
finding them, the optimizer's state, merge_and_unload, the shipped text and adapters, and turning a
model's adapters into the engine's form. Small random models; each test checks what the function
promises (and feeds the validation walk a call to replay)."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch.autograd import no_grad
from minitorch.gpt import GPT, GPTConfig, load_tiny_gpt
from minitorch.lora import (LORA_TARGETS, LoRALinear, QLoRALinear, adapter_arrays, add_lora, load_adapter_arrays,
                            load_source_corpus, lora_layers, lora_parameters, merge_and_unload, merge_lora_,
                            model_adapter, optimizer_state_bytes, shipped_adapters)
from minitorch.nn import Linear
from minitorch.optim import SGD, Adam


@pytest.fixture(scope="module")
def gpt():
    return GPT(GPTConfig(vocab_size=9, block_size=8, n_layer=2, n_head=2, n_embd=8), seed=1)


def test_add_lora_replaces_the_targets_in_a_copy(gpt):
    model = add_lora(gpt, r=2, lora_alpha=4.0, seed=3)
    layers = lora_layers(model)
    assert list(layers) == [f"blocks.{i}.{t}" for i in range(2) for t in LORA_TARGETS]
    assert all(isinstance(layer, LoRALinear) for layer in layers.values())
    assert isinstance(gpt.blocks[0].attn.q, Linear), "the original model keeps its Linears"
    params = lora_parameters(model)
    assert len(params) == 2 * len(layers) and all(p.requires_grad for p in params)
    frozen = [n for n, p in model.named_parameters() if not n.endswith((".lora_A", ".lora_B"))]
    assert frozen and not any(dict(model.named_parameters())[n].requires_grad for n in frozen), "the rest is frozen"
    assert all(p.requires_grad for p in gpt.parameters()), "the original model is not frozen"
    first, second = layers["blocks.0.attn.q"], layers["blocks.0.attn.k"]
    assert not np.array_equal(first.lora_A.numpy(), second.lora_A.numpy()), "each layer draws its own A (seed + i)"
    only_q = add_lora(gpt, r=1, targets=("attn.q",))
    assert list(lora_layers(only_q)) == ["blocks.0.attn.q", "blocks.1.attn.q"]
    q = add_lora(gpt, r=2, targets=("mlp.fc",), layer=QLoRALinear)
    assert all(isinstance(layer, QLoRALinear) for layer in lora_layers(q).values())
    x = np.random.default_rng(0).integers(0, 9, (2, 8))
    with no_grad():
        np.testing.assert_allclose(model(x)[0].numpy(), gpt(x)[0].numpy(), rtol=1e-5, atol=1e-6)  # B = 0


def test_optimizer_state_and_merge_and_unload(gpt):
    model = add_lora(gpt, r=2, lora_alpha=4.0)
    params = lora_parameters(model)
    opt = Adam(params, lr=1e-2)
    x = np.random.default_rng(1).integers(0, 9, (3, 8))
    assert optimizer_state_bytes(opt) == 0, "no state before the first step"
    _, loss = model(x, x)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert optimizer_state_bytes(opt) == 2 * sum(p.data.nbytes for p in params)
    sgd = SGD(params, lr=0.1, momentum=0.9)
    sgd.step()
    assert optimizer_state_bytes(sgd) == sum(p.data.nbytes for p in params)
    merged = merge_and_unload(model)
    assert not lora_layers(merged) and isinstance(merged.blocks[1].mlp.proj, Linear)
    assert merged.num_parameters() == gpt.num_parameters()
    with no_grad():
        np.testing.assert_allclose(merged(x)[0].numpy(), model(x)[0].numpy(), rtol=1e-4, atol=1e-5)
    merge_lora_(lora_layers(model)["blocks.0.attn.q"])  # a merged layer merges from its base weight
    with no_grad():
        np.testing.assert_allclose(merge_and_unload(model)(x)[0].numpy(), merged(x)[0].numpy(), rtol=1e-6, atol=1e-6)


def test_adapter_arrays_round_trip_and_errors(gpt):
    a = add_lora(gpt, r=2, seed=1)
    b = add_lora(gpt, r=2, seed=2)
    arrays = adapter_arrays(a)
    load_adapter_arrays(b, arrays)
    assert all(np.array_equal(v, adapter_arrays(b)[k]) for k, v in arrays.items())
    with pytest.raises(KeyError, match="missing"):
        load_adapter_arrays(b, {k: v for k, v in arrays.items() if "blocks.0" not in k})
    bad = dict(arrays)
    bad["blocks.0.attn.q.lora_A"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"\(3, 3\)"):
        load_adapter_arrays(b, bad)
    adapter = model_adapter(a)
    assert set(adapter) == set(lora_layers(a))
    A, B, s = adapter["blocks.1.mlp.fc"]
    assert A.shape == (8, 2) and B.shape == (2, 32) and s == 8.0


def test_the_shipped_text_and_adapters():
    text = load_source_corpus()
    assert len(text) == 104746 and text.startswith('"""Bisection algorithms."""')
    runs, meta = shipped_adapters()
    tiny, tok = load_tiny_gpt()
    assert all(c in tok.vocab for c in set(text))
    for run, layer in (("lora", LoRALinear), ("qlora", QLoRALinear)):
        model = add_lora(tiny, r=meta[run]["r"], lora_alpha=meta[run]["lora_alpha"], layer=layer)
        load_adapter_arrays(model, runs[run])
        assert np.abs(lora_layers(model)["blocks.0.attn.q"].lora_B.numpy()).max() > 0, "trained adapters"
    assert meta["full"]["losses"]["code"] < meta["lora"]["losses"]["code"] < meta["base"]["losses"]["code"]
