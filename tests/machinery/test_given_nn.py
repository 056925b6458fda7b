"""Lesson 03's given code in minitorch.nn (the layers, MLP, Module.to/train, evaluate, the
state_dict functions) and its contracts: each bad argument is refused with a TypeError or
ValueError that names the parameter and the value, never a raw NumPy error or a silent answer."""

from __future__ import annotations

import numpy as np
import pytest

from minitorch import nn
from minitorch.autograd import Tensor


def test_mlp_layers_and_forward():
    rng = np.random.default_rng(0)
    for activation, act in (("relu", nn.ReLU), ("tanh", nn.Tanh), ("sigmoid", nn.Sigmoid)):
        model = nn.MLP([3, 5, 2], activation=activation, rng=rng)
        assert [type(m) for m in model.layers] == [nn.Linear, act, nn.Linear]
        x = rng.standard_normal((4, 3)).astype(np.float32)
        h = model.layers[0](Tensor(x))
        want = {"relu": np.maximum(h.numpy(), 0), "tanh": np.tanh(h.numpy()),
                "sigmoid": 1 / (1 + np.exp(-h.numpy()))}[activation]
        np.testing.assert_allclose(act().forward(h).numpy(), want, rtol=1e-6)
        out = model.forward(Tensor(x))
        assert out.shape == (4, 2) and np.allclose(out.numpy(), model(x).numpy())
    assert nn.MLP([2, 2], init=0.0, rng=rng)(np.ones((1, 2), np.float32)).numpy().tolist() == [[0.0, 0.0]]


def test_module_train_and_to():
    model = nn.MLP([2, 4, 2], rng=np.random.default_rng(1))
    assert model.train(False) is model and not any(m.training for m in model.modules())
    assert model.train() is model and all(m.training for m in model.modules())
    params = model.parameters()
    assert model.to("cpu") is model and model.parameters() == params and all(p.device == "cpu" for p in params)
    with pytest.raises(ValueError, match="Module.to: device must be a device with a registered backend, got 'tpu'"):
        model.to("tpu")
    with pytest.raises(TypeError, match="Module.train: mode must be True or False, got 'yes'"):
        model.train("yes")


def test_state_dict_functions_round_trip():
    src, dst = nn.MLP([3, 4, 2], rng=np.random.default_rng(2)), nn.MLP([3, 4, 2], rng=np.random.default_rng(3))
    state = nn.state_dict(src)
    assert list(state) == ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    nn.load_state_dict(dst, state)
    for (name, p), q in zip(dst.named_parameters(), src.parameters()):
        assert np.array_equal(p.numpy(), q.numpy()), name
    with pytest.raises(TypeError, match="load_state_dict: state must be a dict.*'weights.npz'"):
        nn.load_state_dict(dst, "weights.npz")
    with pytest.raises(TypeError, match="state_dict: self must be a Module.*None"):
        nn.state_dict(None)


def test_layers_refuse_bad_arguments():
    rng = np.random.default_rng(4)
    for kwargs, error, message in (
            ({"in_features": 0}, ValueError, "Linear: in_features must be an integer >= 1, got 0"),
            ({"out_features": 2.5}, TypeError, "Linear: out_features must be an integer >= 1, got 2.5"),
            ({"init": "xavier"}, ValueError, "Linear: init must be one of 'he', 'glorot', 'lecun'.*'xavier'"),
            ({"init": -0.1}, ValueError, "Linear: init must be .* >= 0.*-0.1"),
            ({"init": True}, TypeError, "Linear: init must be .*True"),
            ({"device": "gpu0"}, ValueError, "Linear: device must be a device with a registered backend, got 'gpu0'")):
        args = {"in_features": 3, "out_features": 2, "rng": rng, **kwargs}
        with pytest.raises(error, match=message):
            nn.Linear(**args)
    for kwargs, error, message in (
            ({"sizes": [3]}, ValueError, r"MLP: sizes must be a sequence of at least 2 items, got \[3\]"),
            ({"sizes": [3, 0, 2]}, ValueError, r"MLP: sizes\[1\] must be an integer >= 1, got 0"),
            ({"activation": "gelu"}, ValueError,
             "MLP: activation must be one of 'relu', 'tanh', 'sigmoid', got 'gelu'"),
            ({"rng": 0}, TypeError, "MLP: rng must be a Generator, got 0")):
        with pytest.raises(error, match=message):
            nn.MLP(**{"sizes": [3, 2], **kwargs})
    with pytest.raises(TypeError, match=r"Sequential: modules\[1\] must be a Module, got <function"):
        nn.Sequential(nn.ReLU(), lambda x: x)
    with pytest.raises(TypeError, match="ReLU.forward: x must be an autograd Tensor, got an array"):
        nn.ReLU().forward(np.ones(3))
    with pytest.raises(ValueError, match="init_std: fan_in must be an integer >= 1, got 0"):
        nn.init_std("he", 0, 3)
    with pytest.raises(TypeError, match="Parameter: data must be .*None"):
        nn.Parameter(None)


def test_cross_entropy_refuses_bad_logits_and_targets():
    z = Tensor(np.zeros((4, 3), np.float32), requires_grad=True)
    with pytest.raises(TypeError, match="cross_entropy: logits must be an autograd Tensor, got an array"):
        nn.cross_entropy(np.zeros((4, 3), np.float32), np.zeros(4, np.int64))
    with pytest.raises(TypeError, match="cross_entropy: logits must be .*dtype float.*int64"):
        nn.cross_entropy(Tensor(np.zeros((4, 3), np.int64)), np.zeros(4, np.int64))
    with pytest.raises(TypeError, match="cross_entropy: targets must be .*dtype int.*None"):
        nn.cross_entropy(z, None)
    with pytest.raises(ValueError, match=r"cross_entropy: targets must have one axis \(N,\).*\(4, 1\)"):
        nn.cross_entropy(z, np.zeros((4, 1), np.int64))
    assert np.isclose(nn.cross_entropy(z, Tensor(np.array([0, 1, 2, 0]))).item(), np.log(3))


def tiny_problem(seed=5):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((20, 3)).astype(np.float32)
    return X, (X[:, 0] > 0).astype(np.int64), nn.MLP([3, 8, 2], rng=rng)


def test_evaluate_and_fit_check_the_data():
    X, y, model = tiny_problem()
    loss, acc = nn.evaluate(model, X, y, batch_size=7)
    assert np.isfinite(loss) and 0 <= acc <= 1 and model.training, "evaluate restores training mode"
    for bad, error, message in ((np.where(y == 1, 2, y), ValueError, r"evaluate: y must hold class indices < 2.*got 2"),
                                (np.where(y == 1, -1, y), ValueError, "evaluate: y must hold class indices >= 0, "
                                                                      "got -1"),
                                (y[:5], ValueError, "evaluate: X has 20 samples .* but y has 5"),
                                (y.astype(np.float64), TypeError, "evaluate: y must be an array of dtype int"),
                                (y[:, None], ValueError, r"evaluate: y must have one axis \(N,\).*\(20, 1\)")):
        with pytest.raises(error, match=message):
            nn.evaluate(model, X, bad)
    with pytest.raises(TypeError, match="evaluate: X must be an array of dtype float32 or float64.*float16"):
        nn.evaluate(model, X.astype(np.float16), y)
    with pytest.raises(ValueError, match="evaluate: batch_size must be an integer >= 1, got 0"):
        nn.evaluate(model, X, y, batch_size=0)
    with pytest.raises(TypeError, match="evaluate: model must be an object with `parameters`.*'mlp'"):
        nn.evaluate("mlp", X, y)

    class Plain:  # an optimiser fit may use: anything with zero_grad and step
        def __init__(self, params):
            self.params = params

        def zero_grad(self):
            for p in self.params:
                p.zero_grad()

        def step(self):
            for p in self.params:
                p.data[...] -= 0.1 * p.grad.data

    hist = nn.fit(model, X, y, Plain(model.parameters()), epochs=2, batch_size=8, progress=False, X_val=X, y_val=y)
    assert len(hist["loss"]) == 2 and len(hist["val_accuracy"]) == 2
    with pytest.raises(ValueError, match=r"fit: y must hold class indices < 2 \(the model's outputs\), got 7"):
        nn.fit(model, X, np.where(y == 1, 7, y), Plain(model.parameters()), epochs=1, progress=False)
    with pytest.raises(ValueError, match="fit: X_val and y_val go together"):
        nn.fit(model, X, y, Plain(model.parameters()), epochs=1, progress=False, X_val=X)
    with pytest.raises(ValueError, match="fit: y_val must hold class indices >= 0, got -1"):
        nn.fit(model, X, y, Plain(model.parameters()), epochs=1, progress=False, X_val=X, y_val=y - 1)
    with pytest.raises(TypeError, match="fit: optimizer must be an object with `zero_grad`, `step`.*'sgd'"):
        nn.fit(model, X, y, "sgd", epochs=1, progress=False)
    with pytest.raises(ValueError, match="fit: epochs must be an integer >= 0, got -1"):
        nn.fit(model, X, y, Plain(model.parameters()), epochs=-1, progress=False)
    assert nn.fit(model, X, y, Plain(model.parameters()), epochs=0, progress=False) == {"loss": [], "accuracy": []}
