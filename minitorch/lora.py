# Generated from solutions/19_adaptation.py by `make build`. Do not edit.
"""minitorch.lora: low-rank adapters (LoRA) on a frozen model, merging them, QLoRA over lesson 10's
int4 groups, many adapters served in one batch by lesson 15's engine, and knowledge distillation."""
from __future__ import annotations

import copy
import gzip
import hashlib
import json
import math
from typing import Any, Callable, Sequence

import numpy as np

from minitorch.autograd import Tensor, log_softmax, no_grad
from minitorch.checks import check_number, describe
from minitorch.gpt import DATA_DIR, GPT, layer_norm_np
from minitorch.nn import Linear, Module, Parameter, cross_entropy
from minitorch.quant import group_size_for, pack_int4, quantize, replace_linears, unpack_int4
from minitorch.kv_cache import GPTWeights, OutOfBlocks, embed, gelu, linear, lm_head, paged_attention
from minitorch.engine import Engine


def frozen_linear(x: Tensor, weight: np.ndarray, bias: np.ndarray | None = None) -> Tensor:
    """x (..., in) @ weight (in, out) + bias (out,), with weight and bias frozen NumPy arrays: one
    autograd node whose backward computes only x's gradient, g @ weight.T. (x @ Tensor(weight) would
    compute the weight's gradient too, and throw it away: a third of a layer's backward work.)"""
    if not isinstance(x, Tensor):
        x = Tensor(np.asarray(x))
    if x.ndim == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"frozen_linear: x {tuple(x.shape)} does not fit weight {weight.shape} (need x (..., "
                         f"{weight.shape[0]}))")
    y = x.data @ weight
    if bias is not None:
        y = y + bias
    return x._record(x._new(y), (x,), lambda g: (g @ weight.T,), "frozen_linear")


class LoRALinear(Module):
    """A frozen Linear plus a trainable low-rank update (LoRA): y = x W + b + (lora_alpha / r) (x A) B.

    Attributes: weight (in, out) and bias (out,) or None, frozen NumPy copies of base's; lora_A (in, r)
    and lora_B (r, out), the only Parameters, in the weight's dtype, A = default_rng(seed).
    standard_normal((in, r)) / sqrt(in), B = 0; r, lora_alpha, scaling = lora_alpha / r; merged (bool:
    the update is inside weight, exercise 19.2)."""

    def __init__(self, base: Linear, r: int = 8, lora_alpha: float = 16.0, seed: int = 0):
        w = base.weight.numpy()
        self.in_features, self.out_features = w.shape
        self.weight = w.copy()
        self.bias = None if base.bias is None else base.bias.numpy().copy()
        self.r, self.lora_alpha = int(r), float(lora_alpha)
        self.scaling = self.lora_alpha / self.r
        rng = np.random.default_rng(seed)
        self.lora_A = Parameter((rng.standard_normal((self.in_features, self.r)) / math.sqrt(self.in_features)).astype(w.dtype))
        self.lora_B = Parameter(np.zeros((self.r, self.out_features), w.dtype))
        self.merged = False

    def forward(self, x: Tensor | np.ndarray) -> Tensor:
        """x (..., in) -> (..., out): x W + b + scaling (x A) B (x W + b alone when merged)."""
        if not isinstance(x, Tensor):
            x = Tensor(np.asarray(x, self.weight.dtype))
        y = frozen_linear(x, self.weight, self.bias)
        if self.merged:
            return y
        return y + ((x @ self.lora_A) @ self.lora_B) * self.scaling

    def __repr__(self) -> str:
        return (f"LoRALinear({self.weight.shape[0]}, {self.weight.shape[1]}, r={self.r}, lora_alpha={self.lora_alpha}"
                f"{', merged' if self.merged else ''})")


LORA_TARGETS = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")


def add_lora(model: Module, r: int = 8, lora_alpha: float = 16.0, targets: Sequence[str] = LORA_TARGETS,
             seed: int = 0, layer: Callable | None = None) -> Module:
    """A copy of `model` in which every Linear whose dotted name ends with one of `targets` is
    replaced by layer(linear, r, lora_alpha, seed=seed + i) (default LoRALinear; i counts the
    replaced layers in order), and every other parameter is frozen (requires_grad False: backward
    computes no gradient for it). The original model is not modified."""
    layer = LoRALinear if layer is None else layer
    count = [0]

    def make(name: str, lin: Linear) -> Module | None:
        if not any(name == t or name.endswith("." + t) for t in targets):
            return None
        count[0] += 1
        return layer(lin, r, lora_alpha, seed=seed + count[0] - 1)

    adapted = replace_linears(model, make)
    for name, p in adapted.named_parameters():
        if not (name.endswith(".lora_A") or name.endswith(".lora_B")):
            p.requires_grad = False
    return adapted


def lora_layers(model: Module) -> dict[str, Module]:
    """{dotted name: layer} of the modules of `model` that carry an adapter (lora_A and lora_B), in
    the order of named_parameters()."""
    out: dict[str, Module] = {}
    names = [n[:-len(".lora_A")] for n, _ in model.named_parameters() if n.endswith(".lora_A")]
    for name in names:
        obj: Any = model
        for part in name.split("."):
            obj = obj[int(part)] if isinstance(obj, (list, tuple)) else getattr(obj, part)
        out[name] = obj
    return out


def lora_parameters(model: Module) -> list[Parameter]:
    """The adapters' Parameters (every lora_A and lora_B), what the optimizer trains."""
    return [p for n, p in model.named_parameters() if n.endswith(".lora_A") or n.endswith(".lora_B")]


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the arrays an optimizer keeps between steps (Adam's m and v; SGD's velocity), as
    allocated now (they appear at the first step)."""
    total = 0
    for name in ("m", "v", "velocity"):
        for a in getattr(optimizer, name, None) or []:
            total += 0 if a is None else int(a.nbytes)
    return total


def lora_delta(layer: Module) -> np.ndarray:
    """The layer's update scaling * A @ B, float64 (in, out)."""
    a = np.asarray(layer.lora_A.numpy(), np.float64)
    b = np.asarray(layer.lora_B.numpy(), np.float64)
    return layer.scaling * (a @ b)


def merge_lora_(layer: Module) -> None:
    """Merge in place: layer.base_weight = the original weight array, layer.weight = W + lora_delta
    (computed in float64, stored in W's dtype), layer.merged = True. A merged layer is left alone."""
    if layer.merged:
        return
    layer.base_weight = layer.weight
    layer.weight = (layer.weight.astype(np.float64) + lora_delta(layer)).astype(layer.weight.dtype)
    layer.merged = True


def unmerge_lora_(layer: Module) -> None:
    """Undo merge_lora_: layer.weight = the original array (bit for bit), layer.merged = False. An
    unmerged layer is left alone."""
    if not layer.merged:
        return
    layer.weight = layer.base_weight
    layer.merged = False


def merge_and_unload(model: Module) -> Module:
    """A copy of `model` in which every layer with an adapter is replaced by a plain Linear of weight
    W + lora_delta (in W's dtype) and the same bias (PEFT's merge_and_unload)."""
    model = copy.deepcopy(model)
    for name, layer in lora_layers(model).items():
        w = layer.base_weight if getattr(layer, "merged", False) else layer.weight
        lin = Linear(w.shape[0], w.shape[1], bias=layer.bias is not None, init=0.0)
        lin.weight = Parameter((w.astype(np.float64) + lora_delta(layer)).astype(w.dtype))
        if layer.bias is not None:
            lin.bias = Parameter(layer.bias.copy())
        _set_module(model, name, lin)
    return model


def _set_module(model: Module, dotted: str, new: Module) -> None:
    *path, last = dotted.split(".")
    obj: Any = model
    for part in path:
        obj = obj[int(part)] if isinstance(obj, (list, tuple)) else getattr(obj, part)
    if isinstance(obj, list):
        obj[int(last)] = new
    else:
        setattr(obj, last, new)


SOURCE = DATA_DIR / "python_source.txt.gz"  # the fine-tuning text; its licence in python_source.NOTICE.md
SOURCE_SHA256 = "27f9bbb75cac0785e5da02096a9e6b4394689c4b0a31dccff75e782bfdb74cfd"
ADAPTERS = DATA_DIR / "tiny_gpt_lora"  # tiny_gpt_lora.npz (trained adapters) + .json (recipes, losses)


def load_source_corpus() -> str:
    """The fine-tuning text: ten modules of Python 3.11.7's standard library, read from
    data/python_source.txt.gz (RuntimeError if its SHA-256 is not SOURCE_SHA256)."""
    text = gzip.decompress(SOURCE.read_bytes()).decode("utf-8")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != SOURCE_SHA256:
        raise RuntimeError(f"{SOURCE} has SHA-256 {digest[:16]}..., not {SOURCE_SHA256[:16]}...: restore the file")
    return text


def adapter_arrays(model: Module) -> dict[str, np.ndarray]:
    """{name.lora_A / name.lora_B: array} of a model's adapters (what save and load move)."""
    out = {}
    for name, layer in lora_layers(model).items():
        out[name + ".lora_A"], out[name + ".lora_B"] = layer.lora_A.numpy().copy(), layer.lora_B.numpy().copy()
    return out


def load_adapter_arrays(model: Module, arrays: dict[str, np.ndarray]) -> Module:
    """Copy `arrays` (adapter_arrays' form) into the adapters of `model`, in place; returns the model.
    KeyError naming an adapter the model lacks or lacks in arrays; ValueError naming a shape mismatch."""
    layers = lora_layers(model)
    wanted = {n + s for n in layers for s in (".lora_A", ".lora_B")}
    if set(arrays) != wanted:
        raise KeyError(f"load_adapter_arrays: missing {sorted(wanted - set(arrays))}, unexpected "
                       f"{sorted(set(arrays) - wanted)}")
    for name, layer in layers.items():
        for part in ("lora_A", "lora_B"):
            p, a = getattr(layer, part), np.asarray(arrays[f"{name}.{part}"])
            if a.shape != tuple(p.shape):
                raise ValueError(f"load_adapter_arrays: {name}.{part} has shape {a.shape}, the adapter {tuple(p.shape)}")
            p.data[...] = a
    return model


def shipped_adapters() -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """The trained adapters shipped in data/tiny_gpt_lora.npz, {run: adapter_arrays}, and the json
    of their recipes and measured losses."""
    meta = json.loads(ADAPTERS.with_suffix(".json").read_text())
    runs: dict[str, dict[str, np.ndarray]] = {}
    with np.load(ADAPTERS.with_suffix(".npz")) as npz:
        for key in npz.files:
            run, name = key.split("/", 1)
            runs.setdefault(run, {})[name] = npz[key]
    return runs, meta


def _train_shipped(out: Any, steps: int = 600, distill_steps: int = 600, eval_windows: int = 64) -> None:
    """How data/tiny_gpt_lora.npz and .json were made (minutes; not run by the lesson or its tests):
    the recipes of sections 2, 3 and 5 at full size, written to out.npz and out.json."""
    import platform
    import time
    from pathlib import Path

    from minitorch.gpt import GPTConfig, evaluate_loss, load_corpus, load_tiny_gpt, split_ids
    from minitorch.sparse import finetune

    out = Path(out)
    tiny, tok = load_tiny_gpt()
    code_train, code_val = split_ids(tok.encode(load_source_corpus()))
    pydoc_train, pydoc_val = split_ids(tok.encode(load_corpus()))

    def losses(model: Module) -> dict[str, float]:
        return {"code": round(evaluate_loss(model, code_val, eval_windows), 4),
                "pydoc": round(evaluate_loss(model, pydoc_val, eval_windows), 4)}

    meta: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__, "eval_windows": eval_windows,
                            "text_sha256": SOURCE_SHA256, "base": {"losses": losses(tiny)}}
    arrays: dict[str, np.ndarray] = {}
    for run, layer, lr in (("lora", LoRALinear, 3e-3), ("qlora", QLoRALinear, 3e-3), ("full", None, 1e-3)):
        t0 = time.perf_counter()
        model = copy.deepcopy(tiny) if layer is None else add_lora(tiny, 8, 16.0, layer=layer)
        params = None if layer is None else lora_parameters(model)
        hist = finetune(model, code_train, steps, params=params, lr=lr, batch_size=16, seed=0)
        meta[run] = {**({} if layer is None else {"r": 8, "lora_alpha": 16.0}), "steps": steps, "batch_size": 16,
                     "lr": lr, "train_seconds": round(time.perf_counter() - t0, 1), "losses": losses(model),
                     "train_loss_last_50": round(float(np.mean(hist[-50:])), 4)}
        if layer is not None:
            arrays.update({f"{run}/{k}": v for k, v in adapter_arrays(model).items()})
    sizes = [16, 32, 48]
    kinds = {"data": {"temperature": 1.0, "alpha": 0.0}, "distilled, T=1": {"temperature": 1.0, "alpha": 1.0},
             "distilled, T=2": {"temperature": 2.0, "alpha": 1.0}}
    results: dict[str, dict[str, list]] = {kind: {"params": [], "val_loss": []} for kind in kinds}
    for width in sizes:
        cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=width)
        for kind, how in kinds.items():
            student = GPT(cfg, seed=0)
            loss_fn = None if how["alpha"] == 0 else _distill_step_loss(tiny, how["temperature"], how["alpha"])
            finetune(student, pydoc_train, distill_steps, lr=3e-3, batch_size=16, seed=0, loss_fn=loss_fn)
            results[kind]["params"].append(student.num_parameters())
            results[kind]["val_loss"].append(round(evaluate_loss(student, pydoc_val, eval_windows), 4))
    meta["distill"] = {"sizes": sizes, "n_layer": 1, "n_head": 2, "steps": distill_steps, "batch_size": 16, "lr": 3e-3,
                       "kinds": kinds, "eval_windows": eval_windows, "teacher_params": tiny.num_parameters(),
                       "teacher_val_loss": meta["base"]["losses"]["pydoc"], "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out.with_suffix(".npz"), **arrays)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")


class QLoRALinear(Module):
    """LoRA over a frozen 4-bit base: the base weight quantised as lesson 10's int4 groups (asymmetric,
    per group of group_size inputs of each output: packed (in * out / 2,) uint8 codes, scale (in /
    group_size, out) float32, zero_point (in / group_size, out) int8), dequantised in every forward;
    lora_A, lora_B, r, lora_alpha, scaling as LoRALinear's, in float32. The group size used is the
    largest divisor of in up to group_size (lesson 10's group_size_for: 64 for the tiny GPT)."""

    def __init__(self, base: Linear, r: int = 8, lora_alpha: float = 16.0, seed: int = 0, group_size: int = 64):
        w = np.asarray(base.weight.numpy(), np.float32)
        self.in_features, self.out_features = w.shape
        group_size = group_size_for(self.in_features, group_size)  # the largest divisor of in up to group_size
        q = quantize(w, bits=4, symmetric=False, block=(group_size, 1))
        self.shape, self.group_size = w.shape, int(group_size)
        self.packed = pack_int4(q.q)
        self.scale = q.scale.astype(np.float32)
        self.zero_point = q.zero_point.astype(np.int8)
        self.bias = None if base.bias is None else base.bias.numpy().astype(np.float32)
        self.r, self.lora_alpha = int(r), float(lora_alpha)
        self.scaling = self.lora_alpha / self.r
        rng = np.random.default_rng(seed)
        self.lora_A = Parameter((rng.standard_normal((self.in_features, self.r)) / math.sqrt(self.in_features)).astype(np.float32))
        self.lora_B = Parameter(np.zeros((self.r, self.out_features), np.float32))
        self.merged = False

    def weight_bytes(self) -> int:
        """Bytes of the stored base weight: the packed codes, the scales and the zero points."""
        return int(self.packed.nbytes + self.scale.nbytes + self.zero_point.nbytes)

    def dequantized_weight(self) -> np.ndarray:
        """The base weight as float32 (in, out): (q - zero_point) * scale, each group's scale and zero
        point applied to its group_size rows."""
        q = unpack_int4(self.packed, self.shape).astype(np.float32)
        s = np.repeat(self.scale, self.group_size, axis=0)
        z = np.repeat(self.zero_point, self.group_size, axis=0).astype(np.float32)
        return (q - z) * s

    def forward(self, x: Tensor | np.ndarray) -> Tensor:
        """x (..., in) -> (..., out): x W + b + scaling (x A) B, W = dequantized_weight() (not kept)."""
        if not isinstance(x, Tensor):
            x = Tensor(np.asarray(x, np.float32))
        y = frozen_linear(x, self.dequantized_weight(), self.bias)
        return y + ((x @ self.lora_A) @ self.lora_B) * self.scaling

    def __repr__(self) -> str:
        return f"QLoRALinear({self.in_features}, {self.out_features}, r={self.r}, int4 groups of {self.group_size})"


def stack_adapters(adapters: dict[str, dict[str, tuple]], W: GPTWeights) -> dict[str, tuple]:
    """adapters {adapter name: {linear name: (A (in, r), B (r, out), scaling)}} as
    {linear name: (A (n, in, r_max), B (n, r_max, out), scales (n,))}, n = len(adapters) in their
    order; an adapter of lower rank, or without that linear, is padded with zeros (no effect)."""
    names = list(adapters)
    linears = sorted({lin for adapter in adapters.values() for lin in adapter})
    out = {}
    for lin in linears:
        if lin + ".weight" not in W.params:
            raise ValueError(f"stack_adapters: {lin!r} is not a Linear of the model")
        d_in, d_out = W.params[lin + ".weight"].shape
        r_max = max(adapters[a][lin][0].shape[1] for a in names if lin in adapters[a])
        A = np.zeros((len(names), d_in, r_max), W.dtype)
        B = np.zeros((len(names), r_max, d_out), W.dtype)
        scales = np.zeros(len(names), np.float64)
        for i, a in enumerate(names):
            if lin in adapters[a]:
                a_, b_, s_ = adapters[a][lin]
                if a_.shape[0] != d_in or b_.shape[1] != d_out or a_.shape[1] != b_.shape[0]:
                    raise ValueError(f"stack_adapters: adapter {a!r} on {lin!r} has A {a_.shape}, B {b_.shape}; the "
                                     f"Linear is ({d_in}, {d_out})")
                A[i, :, :a_.shape[1]], B[i, :b_.shape[0], :], scales[i] = a_, b_, s_
        out[lin] = (A, B, scales)
    return out


def model_adapter(model: Module) -> dict[str, tuple]:
    """{linear name: (A, B, scaling)} of a model with LoRA layers (add_lora), as arrays: one adapter."""
    return {name: (layer.lora_A.numpy().copy(), layer.lora_B.numpy().copy(), float(layer.scaling))
            for name, layer in lora_layers(model).items()}


def merge_adapter_weights(W: GPTWeights, adapter: dict[str, tuple]) -> GPTWeights:
    """A copy of W with one adapter {linear name: (A, B, scaling)} merged into its weights:
    weight + scaling * A @ B (computed in float64, stored in W's dtype)."""
    from dataclasses import replace

    params = dict(W.params)
    for lin, (a, b, s) in adapter.items():
        w = params[lin + ".weight"]
        params[lin + ".weight"] = (w.astype(np.float64) + s * (np.asarray(a, np.float64) @ np.asarray(b, np.float64))).astype(w.dtype)
    return replace(W, params=params)


def lora_paged_forward(W: GPTWeights, cache: Any, seqs: Sequence[Any], chunks: Sequence[np.ndarray],
                       adapter_of_seq: Sequence[int], stacks: dict[str, tuple], lora_fn: Callable | None = None) -> np.ndarray:
    """Lesson 11's paged_forward with adapters: every Linear named in `stacks` (stack_adapters' form)
    adds lora_fn(h, A, B, scales, the adapter of each token) to its output, each token of chunks[i]
    using adapter_of_seq[i] (-1: none). Returns (len(seqs), vocab), the logits of each chunk's last token."""
    lora_fn = lora_batched if lora_fn is None else lora_fn
    if not (len(seqs) == len(chunks) == len(adapter_of_seq)) or not seqs:
        raise ValueError(f"lora_paged_forward: seqs, chunks and adapter_of_seq must have one length >= 1, got "
                         f"{len(seqs)}, {len(chunks)} and {len(adapter_of_seq)}")
    chunks = [np.asarray(c, np.int64).reshape(-1) for c in chunks]
    need = sum(cache.blocks_needed(s, len(c)) for s, c in zip(seqs, chunks))
    if need > cache.num_free:
        raise OutOfBlocks(f"lora_paged_forward: the step needs {need} blocks, {cache.num_free} are free")
    starts = [cache.lengths[s] for s in seqs]
    slots = np.concatenate([cache.append(s, len(c)) for s, c in zip(seqs, chunks)])
    bounds = np.cumsum([0] + [len(c) for c in chunks])
    pos = np.concatenate([n + np.arange(len(c)) for n, c in zip(starts, chunks)])
    rows = np.repeat(np.asarray(adapter_of_seq, np.int64), [len(c) for c in chunks])
    p = W.params

    def lin(h: np.ndarray, name: str) -> np.ndarray:  # h (1, N, in)
        y = linear(h, p, name)
        if name in stacks:
            a, b, s = stacks[name]
            y = y + lora_fn(h[0], a, b, s, rows)[None]
        return y

    x = embed(W, np.concatenate(chunks)[None], pos[None])
    table = cache.block_table(seqs)
    lengths = np.array([cache.lengths[s] for s in seqs])
    n_tokens = int(bounds[-1])
    single = [j for j, c in enumerate(chunks) if len(c) == 1]  # decodes: attend in one call (as paged_forward)
    multi = [j for j, c in enumerate(chunks) if len(c) > 1]
    for i in range(W.n_layer):
        pre = f"blocks.{i}."
        h = layer_norm_np(x, p[pre + "ln1.weight"], p[pre + "ln1.bias"], W.ln_eps)
        q = lin(h, pre + "attn.q").reshape(1, n_tokens, W.n_head, -1).transpose(0, 2, 1, 3)
        k = lin(h, pre + "attn.k").reshape(1, n_tokens, W.n_kv_head, -1).transpose(0, 2, 1, 3)
        v = lin(h, pre + "attn.v").reshape(1, n_tokens, W.n_kv_head, -1).transpose(0, 2, 1, 3)
        cache.write(i, slots, k[0], v[0])
        o = np.empty_like(q)
        if single:
            at = bounds[single]
            q1 = q[0][:, at].transpose(1, 0, 2)[:, :, None]
            o[0][:, at] = paged_attention(q1, cache.k[i], cache.v[i], table[single], lengths[single])[:, :, 0].transpose(1, 0, 2)
        for j in multi:
            seg = slice(bounds[j], bounds[j + 1])
            o[:, :, seg] = paged_attention(q[:, :, seg], cache.k[i], cache.v[i], table[j:j + 1], lengths[j:j + 1])
        x = x + lin(o.transpose(0, 2, 1, 3).reshape(1, n_tokens, -1), pre + "attn.proj")
        h = layer_norm_np(x, p[pre + "ln2.weight"], p[pre + "ln2.bias"], W.ln_eps)
        x = x + lin(gelu(lin(h, pre + "mlp.fc")), pre + "mlp.proj")
    return lm_head(W, x[0, bounds[1:] - 1])


class AdapterEngine(Engine):
    """Lesson 15's Engine serving one base model with many LoRA adapters in the same batch.

    adapters: {name: {linear name: (A (in, r), B (r, out), scaling)}} (model_adapter's form); every
    other argument is Engine's, except decode ("reference": the adapters go through
    lora_paged_forward) and prefix_caching (off). lora_fn: the batched low-rank product (default
    lora_batched). add_request(..., adapter=name or None) tags a request with its adapter."""

    def __init__(self, W: GPTWeights, adapters: dict[str, dict[str, tuple]], lora_fn: Callable | None = None,
                 **engine_kw: Any):
        if not hasattr(Engine, "_forward"):
            raise RuntimeError("AdapterEngine: lesson 15's Engine no longer runs the model through _forward")
        super().__init__(W, **{**engine_kw, "decode": "reference", "prefix_caching": False})
        self.adapter_names = list(adapters)
        self.stacks = stack_adapters(adapters, W)
        self.lora_fn = lora_batched if lora_fn is None else lora_fn

    def add_request(self, prompt: Any, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                    on_token: Callable | None = None, adapter: str | None = None) -> Any:
        """Engine.add_request, for the adapter named `adapter` (None: the base model). ValueError
        naming an adapter the engine does not hold."""
        if adapter is not None and adapter not in self.adapter_names:
            raise ValueError(f"AdapterEngine.add_request: adapter must be one of {self.adapter_names} or None, "
                             f"got {adapter!r}")
        index = -1 if adapter is None else self.adapter_names.index(adapter)
        with self.lock:  # tagged before the step loop can see it
            request = super().add_request(prompt, max_tokens, temperature, seed, on_token)
            request.adapter_index = index
        return request

    def _forward(self, plan: list) -> np.ndarray:
        chunks = [r.tokens[r.num_computed:r.num_computed + n] for r, n in plan]
        return lora_paged_forward(self.W, self.cache, [r.id for r, _ in plan], chunks,
                                  [getattr(r, "adapter_index", -1) for r, _ in plan], self.stacks, self.lora_fn)


def lora_batched(x: np.ndarray, A: np.ndarray, B: np.ndarray, scales: np.ndarray, adapter_of_row: np.ndarray,
                 matmul: Callable | None = None) -> np.ndarray:
    """The low-rank updates of a batch whose rows use different adapters: row n gets scales[a] *
    (x[n] @ A[a]) @ B[a], a = adapter_of_row[n], or zeros where a = -1. x (N, in); A (n_adapters, in, r);
    B (n_adapters, r, out); scales (n_adapters,); adapter_of_row (N,) ints in [-1, n_adapters). Rows are
    grouped by adapter: two matmul calls (default np.matmul) per adapter present. Returns (N, out)
    in np.result_type(x, A, B)."""
    matmul = np.matmul if matmul is None else matmul
    x, A, B = np.asarray(x), np.asarray(A), np.asarray(B)
    scales, ids = np.asarray(scales), np.asarray(adapter_of_row)
    n_adapters = A.shape[0]
    if ids.shape != (x.shape[0],) or (ids.size and (ids.min() < -1 or ids.max() >= n_adapters)):
        raise ValueError(f"lora_batched: adapter_of_row must be (N,) = ({x.shape[0]},) ids in [-1, {n_adapters}), got "
                         f"{describe(adapter_of_row)}" + (f" with values {ids.min()}..{ids.max()}" if ids.size else ""))
    out = np.zeros((x.shape[0], B.shape[2]), np.result_type(x, A, B))
    for a in np.unique(ids[ids >= 0]):
        rows = np.flatnonzero(ids == a)
        out[rows] = matmul(matmul(x[rows], A[a]), B[a]) * scales[a]
    return out


def distillation_loss(student_logits: Tensor, teacher_logits: np.ndarray, targets: np.ndarray | None = None,
                      temperature: float = 2.0, alpha: float = 0.5) -> Tensor:
    """Hinton et al.'s loss: alpha * T^2 * KL(p_T || q_T) + (1 - alpha) * cross_entropy(student, targets),
    p_T = softmax(teacher_logits / T), q_T = softmax(student_logits / T), T = temperature; the KL summed
    over the vocabulary and averaged over the rows. student_logits (N, V) Tensor; teacher_logits (N, V)
    array; targets (N,) ints or None (alpha == 1 only). A one-element Tensor in the student's dtype."""
    t = check_number("distillation_loss", "temperature", temperature, 0.0)
    if t <= 0:
        raise ValueError(f"distillation_loss: temperature must be > 0, got {temperature}")
    teacher = np.asarray(teacher_logits, np.float64)
    if teacher.shape != tuple(student_logits.shape) or teacher.ndim != 2:
        raise ValueError(f"distillation_loss: teacher_logits must have the student's shape (N, V) "
                         f"{tuple(student_logits.shape)}, got {teacher.shape}")
    if targets is None and alpha < 1:
        raise ValueError(f"distillation_loss: targets are needed for the hard-label term when alpha < 1, got "
                         f"targets=None with alpha={alpha}")
    if targets is not None:
        y = np.asarray(targets)
        if y.shape != teacher.shape[:1] or (y.size and (y.min() < 0 or y.max() >= teacher.shape[1])):
            raise ValueError(f"distillation_loss: targets must be ({teacher.shape[0]},) ids in [0, {teacher.shape[1]}), "
                             f"got {describe(targets)}" + (f" with values {y.min()}..{y.max()}" if y.size else ""))
    dtype = student_logits.dtype
    z = teacher / t
    log_p = z - z.max(axis=-1, keepdims=True)
    log_p = log_p - np.log(np.exp(log_p).sum(axis=-1, keepdims=True))
    p = np.exp(log_p)
    log_q = log_softmax(student_logits * (1.0 / t), axis=-1)
    kl = (Tensor((p * log_p).astype(dtype)) - log_q * Tensor(p.astype(dtype))).sum(axis=-1).mean()
    loss = kl * (alpha * t * t)
    if alpha < 1:
        loss = loss + cross_entropy(student_logits, np.asarray(targets)) * (1.0 - alpha)
    return loss


def _distill_step_loss(teacher: Module, temperature: float = 1.0, alpha: float = 1.0) -> Callable:
    """A loss_fn(model, x, y) for lesson 18's finetune: the distillation loss of the student `model`'s
    logits on the batch against `teacher`'s (run without gradients), every position a row."""
    def loss_fn(model: Module, x: np.ndarray, y: np.ndarray) -> Tensor:
        with no_grad():
            t_logits = teacher(x)[0].numpy()
        s_logits, _ = model(x)
        v = s_logits.shape[-1]
        return distillation_loss(s_logits.reshape(-1, v), t_logits.reshape(-1, v), y.reshape(-1), temperature, alpha)

    return loss_fn


from minitorch.checks import (Array, Attrs, Count, Fraction, Func, Instance, Int, Optional, Positive, Seq,  # noqa: E402
                              Size, TensorLike, Unchecked, validate_public)

_MODULE = Instance(Module, must="a minitorch Module")
_LAYER = Attrs("weight", "lora_A", "lora_B", "scaling", "merged")
validate_public(globals(), {
    "frozen_linear": {"x": TensorLike(dtypes=("float32", "float64")), "weight": Array(ndim=2, dtypes=("float32", "float64")),
                      "bias": Optional(Array(ndim=1, dtypes=("float32", "float64")))},
    "LoRALinear": {"base": Instance(Linear), "r": Size, "lora_alpha": Positive, "seed": Count},
    "LoRALinear.forward": {"x": TensorLike(dtypes="real")},
    "add_lora": {"model": _MODULE, "r": Size, "lora_alpha": Positive, "targets": Seq(), "seed": Count,
                 "layer": Optional(Func())},
    "lora_layers": {"model": _MODULE},
    "lora_parameters": {"model": _MODULE},
    "optimizer_state_bytes": {"optimizer": Attrs("step")},
    "lora_delta": {"layer": _LAYER},
    "merge_lora_": {"layer": _LAYER},
    "unmerge_lora_": {"layer": _LAYER},
    "merge_and_unload": {"model": _MODULE},
    "adapter_arrays": {"model": _MODULE},
    "load_adapter_arrays": {"model": _MODULE, "arrays": Instance(dict, must="a dict {name: array}")},
    "QLoRALinear": {"base": Instance(Linear), "r": Size, "lora_alpha": Positive, "seed": Count, "group_size": Size},
    "QLoRALinear.forward": {"x": TensorLike(dtypes="real")},
    "lora_batched": {"x": Array(ndim=2, dtypes=("float32", "float64")), "A": Array(ndim=3, dtypes=("float32", "float64")),
                     "B": Array(ndim=3, dtypes=("float32", "float64")), "scales": Array(ndim=1, dtypes="real"),
                     "adapter_of_row": Array(ndim=1, dtypes="int"), "matmul": Optional(Func())},
    "stack_adapters": {"adapters": Instance(dict, must="a dict {adapter name: {linear name: (A, B, scaling)}}"),
                       "W": Instance(GPTWeights)},
    "model_adapter": {"model": _MODULE},
    "merge_adapter_weights": {"W": Instance(GPTWeights), "adapter": Instance(dict, must="a dict {linear: (A, B, s)}")},
    "lora_paged_forward": {"W": Instance(GPTWeights), "cache": Attrs("append", "write", "block_table", "lengths"),
                           "seqs": Seq(), "chunks": Seq(), "adapter_of_seq": Seq(Int(-1)), "stacks": Instance(dict),
                           "lora_fn": Optional(Func())},
    "AdapterEngine": {"W": Instance(GPTWeights), "adapters": Instance(dict, must="a dict {adapter name: adapter}"),
                      "lora_fn": Optional(Func())},
    "AdapterEngine.add_request": {"adapter": Optional(Unchecked())},
    "distillation_loss": {"student_logits": Instance(Tensor, must="a minitorch Tensor (N, V)"),
                          "teacher_logits": Array(ndim=2, dtypes=("float32", "float64")),
                          "targets": Optional(Array(ndim=1, dtypes="int")), "temperature": Positive,
                          "alpha": Fraction},
})
