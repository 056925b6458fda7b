# %% [markdown]
# # Lesson 19: efficient adaptation: LoRA, QLoRA, many adapters, distillation
#
# Lesson 18 made a model cheaper by removing weights. This lesson makes it cheap to *change*: to
# teach a trained model a new domain without paying for full fine-tuning, to keep many such
# variants of one model and serve them together, and to pass what a big model knows to a small
# one. All four on lesson 09's tiny GPT, which read Python's help pages and now learns Python's
# source code:
#
# 1. **LoRA** (19.1, 19.2; Hu et al. 2022): freeze the weights and learn a low-rank update
#    `W + (alpha / r) A B` of a few of them. Only A and B train, so the gradients and the optimizer's
#    state shrink to theirs; for inference the update merges into W and costs nothing.
# 2. **QLoRA** (19.3; Dettmers et al. 2023): keep the frozen base in lesson 10's 4-bit groups,
#    dequantised on the fly in each forward pass, with the adapters in float.
# 3. **Many adapters in one batch** (19.4): lesson 15's engine serves requests for different
#    adapters in the same step, one pass of the base weights for all and a gathered low-rank
#    product per adapter (Punica, Chen et al. 2024; S-LoRA, Sheng et al. 2024), against one merged
#    model per adapter.
# 4. **Distillation** (19.5; Hinton et al. 2015): a smaller GPT trained on the tiny GPT's
#    softened predictions (KL at a temperature) against the same model trained on the text alone.
#
# The course's reference version of this lesson is `minitorch/lora.py`. Background: the bytes of
# training in [optimizer memory](../hardware_notes/optimizer_memory.md), 4-bit formats in
# [number formats](../hardware_notes/number_formats.md), serving in
# [inference](../hardware_notes/inference.md#serving), and the memory of adapters served together
# in [sparsity](../hardware_notes/sparsity.md#adapters-in-memory). Hugging Face's PEFT library is
# what you meet next; its names are used where they fit (`r`, `lora_alpha`, `lora_A`, `lora_B`,
# `merge_and_unload`).
#
# Conventions: a Linear's weight is (in, out) and y = x W + b (lesson 03), so A is (in, r) and B is
# (r, out) (PEFT stores the transposes). Training text: `data/python_source.txt.gz`, the source of
# ten modules of Python 3.11.7's standard library (PSF licence: `data/python_source.NOTICE.md`).

# %%
import copy
import os
import time

import matplotlib.pyplot as plt
import numpy as np

from course.check import check

SMALL = os.environ.get("MINITORCH_SMALL") == "1"

# %%
#| default_exp lora
#| export
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

# %% [markdown]
# ## 1. LoRA: a low-rank update on frozen weights
#
# Fine-tuning all of a model's weights needs, for each weight, its gradient and (Adam) two moments:
# with mixed precision, 16 bytes per parameter before the activations
# ([optimizer memory](../hardware_notes/optimizer_memory.md)); a 7B model needs over 100 GB to
# fine-tune. Hu et al. (2022) observed that the *change* fine-tuning makes to a weight matrix has
# low "intrinsic rank", and train only that change, factored:
#
# $$y = x W + b + \frac{\alpha}{r}\, (x A) B, \qquad A \in \mathbb{R}^{in \times r},\ B \in \mathbb{R}^{r \times out}.$$
#
# W and b are frozen. A starts random and **B starts at zero**, so the model starts exactly as the
# pretrained one, and the update grows from there. The **scaling** `alpha / r` (`lora_alpha / r`)
# keeps the update's size roughly independent of the rank: change r and the learning rate that
# worked still works. A rank of 8 on a 4096 x 4096 matrix trains 65,536 numbers instead of 16.8
# million.
#
# **Exercise 19.1.** Write `LoRALinear`: `__init__` copies the base Linear's weight and bias as
# plain NumPy arrays (frozen: not Parameters, so `parameters()` yields only the adapter) into
# `self.weight` (in, out) and `self.bias` (out,) or None, and sets `self.r`, `self.lora_alpha`,
# `self.scaling = lora_alpha / r`, `self.merged = False`, and the two Parameters, in the base
# weight's dtype:
#
# - `self.lora_A` (in, r) = `np.random.default_rng(seed).standard_normal((in, r)) / sqrt(in)`;
# - `self.lora_B` (r, out) = zeros.
#
# `forward(x)` (x (..., in), a Tensor or array) returns x W + b + scaling (x A) B, through
# `frozen_linear` for the frozen part; when `self.merged` is True the update is already inside
# `self.weight` (exercise 19.2) and the forward is x W + b alone.

# %%
#| export
#| exercise 19.1
class LoRALinear(Module):
    """A frozen Linear plus a trainable low-rank update (LoRA): y = x W + b + (lora_alpha / r) (x A) B.

    Attributes: weight (in, out) and bias (out,) or None, frozen NumPy copies of base's; lora_A (in, r)
    and lora_B (r, out), the only Parameters, in the weight's dtype, A = default_rng(seed).
    standard_normal((in, r)) / sqrt(in), B = 0; r, lora_alpha, scaling = lora_alpha / r; merged (bool:
    the update is inside weight, exercise 19.2)."""

    def __init__(self, base: Linear, r: int = 8, lora_alpha: float = 16.0, seed: int = 0):
        ### BEGIN SOLUTION
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
        ### END SOLUTION

    def forward(self, x: Tensor | np.ndarray) -> Tensor:
        """x (..., in) -> (..., out): x W + b + scaling (x A) B (x W + b alone when merged)."""
        ### BEGIN SOLUTION
        if not isinstance(x, Tensor):
            x = Tensor(np.asarray(x, self.weight.dtype))
        y = frozen_linear(x, self.weight, self.bias)
        if self.merged:
            return y
        return y + ((x @ self.lora_A) @ self.lora_B) * self.scaling
        ### END SOLUTION

    def __repr__(self) -> str:
        return (f"LoRALinear({self.weight.shape[0]}, {self.weight.shape[1]}, r={self.r}, lora_alpha={self.lora_alpha}"
                f"{', merged' if self.merged else ''})")

# %% tags=["check"]
check("19.1")

# %% [markdown]
# Given: `add_lora` puts a `LoRALinear` in place of each Linear whose name ends with one of
# `targets` (all of the tiny GPT's attention and MLP Linears by default; PEFT's `target_modules`),
# in a copy of the model, and freezes everything else (`requires_grad = False`, as PEFT does: the
# embeddings and LayerNorms get no gradient); `lora_parameters` lists the adapters' Parameters, the
# only ones the optimizer gets.

# %%
#| export
#| given
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

# %% [markdown]
# What LoRA saves, measured: the tiny GPT fine-tuned in full and with rank-8 adapters on all six
# Linears of each block, one Adam step each on the same batch, then the trainable numbers, their
# gradients and Adam's state, counted from the arrays themselves. At this size the adapters are not
# small beside the matrices (64 x 8 + 8 x 64 against 64 x 64), so the saving is modest; the second
# half of the cell does the same count for the shapes of Llama-2 7B (32 layers, d = 4096, MLP 11,008
# wide with three matrices), where rank 16 on the attention's q and v (the original paper's choice)
# trains under 0.2% of the weights.

# %% tags=["demo"]
from minitorch.gpt import get_batch, load_corpus, load_tiny_gpt, split_ids
from minitorch.optim import Adam

tiny, tok = load_tiny_gpt()
xb, yb = get_batch(split_ids(tok.encode(load_corpus()))[0], 8, 64, np.random.default_rng(0))


def one_step(model, params):
    opt = Adam(params, lr=1e-3)
    _, loss = model(xb, yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    grads = sum(p.grad.data.nbytes for p in model.parameters() if p.grad is not None)  # all backward made
    return sum(p.size for p in params), grads, optimizer_state_bytes(opt)


full = copy.deepcopy(tiny)
lora_model = add_lora(tiny, r=8, lora_alpha=16)
for label, model, params in [("full fine-tuning", full, full.parameters()),
                             ("LoRA r=8, all Linears", lora_model, lora_parameters(lora_model))]:
    n, g, s = one_step(model, list(params))
    print(f"{label:>22}: {n:7,} trainable numbers ({n / tiny.num_parameters():6.1%} of {tiny.num_parameters():,}), "
          f"gradients {g / 1e3:6.1f} kB, Adam state {s / 1e3:6.1f} kB")

layers, d, ff = 32, 4096, 11008
full_7b = layers * (4 * d * d + 3 * d * ff)
lora_7b = layers * 2 * (d * 16 + 16 * d)
print(f"Llama-2 7B shapes: {full_7b / 1e9:.2f} B matrix weights; LoRA r=16 on q and v: {lora_7b / 1e6:.1f} M "
      f"({lora_7b / full_7b:.3%}); Adam state in fp32: {8 * full_7b / 1e9:.0f} GB full, {8 * lora_7b / 1e6:.0f} MB LoRA")

# %% [markdown]
# ## 2. Merging, and a fine-tuning task
#
# After training, `W' = W + (alpha / r) A B` is one matrix of the original shape: merge it and the
# adapted model runs exactly as fast as the base (PEFT's `merge_and_unload`). Keep W and the adapter
# apart instead and you can switch adapters, or serve several at once (section 4).
#
# Merging must not damage W. Adding the update into W in place and subtracting it to unmerge looks
# symmetric but is not: in float32, `(W + D) - D` is W rounded twice, and every merge-unmerge cycle
# (switching adapters back and forth) moves W further from the trained weights. So unmerging restores
# the original array that merging set aside, and merging twice is the same as merging once.
#
# **Exercise 19.2.** Write `lora_delta` (the update `scaling * A @ B`, computed in float64),
# `merge_lora_` (sets the original weight aside in `layer.base_weight`, puts `W + delta` in
# `layer.weight` in W's dtype, sets `layer.merged`; a no-op on a merged layer) and `unmerge_lora_`
# (puts the original array back, bit for bit; a no-op on an unmerged layer). They use only the
# attributes of exercise 19.1's layer (`weight`, `lora_A`, `lora_B`, `scaling`, `merged`).

# %%
#| export
#| exercise 19.2
def lora_delta(layer: Module) -> np.ndarray:
    """The layer's update scaling * A @ B, float64 (in, out)."""
    ### BEGIN SOLUTION
    a = np.asarray(layer.lora_A.numpy(), np.float64)
    b = np.asarray(layer.lora_B.numpy(), np.float64)
    return layer.scaling * (a @ b)
    ### END SOLUTION


def merge_lora_(layer: Module) -> None:
    """Merge in place: layer.base_weight = the original weight array, layer.weight = W + lora_delta
    (computed in float64, stored in W's dtype), layer.merged = True. A merged layer is left alone."""
    ### BEGIN SOLUTION
    if layer.merged:
        return
    layer.base_weight = layer.weight
    layer.weight = (layer.weight.astype(np.float64) + lora_delta(layer)).astype(layer.weight.dtype)
    layer.merged = True
    ### END SOLUTION


def unmerge_lora_(layer: Module) -> None:
    """Undo merge_lora_: layer.weight = the original array (bit for bit), layer.merged = False. An
    unmerged layer is left alone."""
    ### BEGIN SOLUTION
    if not layer.merged:
        return
    layer.weight = layer.base_weight
    layer.merged = False
    ### END SOLUTION

# %% tags=["check"]
check("19.2")

# %%
#| export
#| given
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

# %% [markdown]
# The task: Python source code, which the tiny GPT never read (it learnt the help pages, prose with
# some examples). The base model's loss on held-out source is far above its loss on the help pages.
# Rank-8 adapters (`lora_alpha` 16) on every Linear are trained for 600 steps of 16 windows (Adam,
# learning rate 3e-3), only A and B moving, and compared with full fine-tuning for the same steps
# (Adam, learning rate 1e-3), on the held-out source and on the help pages, to see what each
# forgets.
#
# `TRAIN` chooses, as in lesson 09: `False` (the default) loads the adapters shipped in
# `data/tiny_gpt_lora.npz`, trained by this recipe, and prints the losses recorded in their json
# (the full fine-tuning run is recorded there, not shipped); `True` (or `MINITORCH_TRAIN=1 make demo
# L=19`) trains them here, a few minutes (the json records how long the shipped runs took). With
# `MINITORCH_SMALL=1` it trains a few steps (the loop working) and evaluates on fewer windows.

# %% tags=["demo"]
from minitorch.gpt import evaluate_loss
from minitorch.sparse import finetune

TRAIN = os.environ.get("MINITORCH_TRAIN") == "1"
code = tok.encode(load_source_corpus())
code_train, code_val = split_ids(code)
pydoc_val = split_ids(tok.encode(load_corpus()))[1]
EVAL = 8 if SMALL else 64
runs, meta = shipped_adapters()
STEPS = 5 if SMALL else meta["lora"]["steps"]
RECIPE = dict(batch_size=16, seed=0)
t_cell = time.perf_counter()
lora_model = add_lora(tiny, r=meta["lora"]["r"], lora_alpha=meta["lora"]["lora_alpha"])
if TRAIN or SMALL:
    lora_hist = finetune(lora_model, code_train, STEPS, params=lora_parameters(lora_model), lr=3e-3, **RECIPE)
    print(f"LoRA: trained {STEPS} steps here, last loss {lora_hist[-1]:.3f}")
else:
    load_adapter_arrays(lora_model, runs["lora"])
    print(f"LoRA: loaded the shipped adapters ({meta['lora']['steps']} steps, trained in "
          f"{meta['lora']['train_seconds']:.0f} s)")
results = {"base": {"code": evaluate_loss(tiny, code_val, EVAL), "pydoc": evaluate_loss(tiny, pydoc_val, EVAL)},
           "LoRA r=8": {"code": evaluate_loss(lora_model, code_val, EVAL), "pydoc": evaluate_loss(lora_model, pydoc_val, EVAL)}}
if TRAIN:
    full = copy.deepcopy(tiny)
    finetune(full, code_train, STEPS, lr=1e-3, **RECIPE)
    results["full fine-tuning"] = {"code": evaluate_loss(full, code_val, EVAL), "pydoc": evaluate_loss(full, pydoc_val, EVAL)}
else:
    results["full fine-tuning (recorded)"] = meta["full"]["losses"]
print(f"val loss, nats/char ({EVAL} windows; the recorded run: {meta['eval_windows']}):")
for label, r in results.items():
    print(f"  {label:>28}: Python source {r['code']:.3f}   help pages {r['pydoc']:.3f}")
print(f"recorded for the shipped LoRA run: {meta['lora']['losses']}; this cell took {time.perf_counter() - t_cell:.0f} s")

# %% [markdown]
# Read the recorded rows (64 windows each): the adapters take the loss on Python source most of the
# way that full fine-tuning does, with a sixth of the trainable numbers, and full fine-tuning forgets
# more of the help pages on the way. That is Biderman et al.'s finding ("LoRA learns less and forgets
# less") in small. A sample from each model after the same prompt (temperature 0.8): the base writes
# help-page prose, the adapted one something closer to code.

# %% tags=["demo"]
from minitorch.gpt import generate

prompt = "def "
for label, model in [("base", tiny), ("LoRA", lora_model)]:
    out = generate(model, tok.encode(prompt), 120 if not SMALL else 40, temperature=0.8, rng=np.random.default_rng(1))
    print(f"--- {label}:\n{tok.decode(out)}\n")

# %% [markdown]
# And merged: `merge_and_unload` gives plain Linears whose outputs equal the adapted model's (to
# float32 rounding), and the same number of multiplications as the base.

# %% tags=["demo"]
merged = merge_and_unload(lora_model)
with no_grad():
    a_logits, _ = lora_model(xb[:2])
    m_logits, _ = merged(xb[:2])
print(f"largest difference of logits, adapters vs merged: {np.abs(a_logits.numpy() - m_logits.numpy()).max():.2e}; "
      f"merged model's parameters {merged.num_parameters():,} = base {tiny.num_parameters():,}")

# %% [markdown]
# ## 3. QLoRA: adapters on a 4-bit base
#
# LoRA removes the optimizer's state, but the frozen weights still sit in memory in 16 or 32 bits.
# QLoRA (Dettmers et al. 2023) stores them in 4 bits and dequantises each matrix on the fly, in
# the forward (and backward) pass, for the one matrix product it is needed for; the adapters stay
# in float and get exact gradients. A 65B model then fine-tunes on one 48 GB GPU. QLoRA's 4-bit
# format is NF4 (a 4-bit code whose 16 levels are quantiles of a normal distribution) with its
# scales themselves quantised ("double quantization"); here it is lesson 10's int4 groups: per
# group of `group_size` inputs of each output, a float32 scale and a zero point, the 4-bit codes
# packed two per byte (`pack_int4`).
#
# **Exercise 19.3.** `QLoRALinear.__init__` (given) quantises the base weight and sets up the
# adapter as `LoRALinear` does. Write `dequantized_weight`, the float32 (in, out) matrix
# `(q - zero_point) * scale` from the packed codes, and `forward`: x W + b + scaling (x A) B with W
# the dequantized weight, made afresh in every call and never kept (the tests check that the layer
# holds no float copy of W).

# %%
#| export
#| exercise 19.3
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
        ### BEGIN SOLUTION
        q = unpack_int4(self.packed, self.shape).astype(np.float32)
        s = np.repeat(self.scale, self.group_size, axis=0)
        z = np.repeat(self.zero_point, self.group_size, axis=0).astype(np.float32)
        return (q - z) * s
        ### END SOLUTION

    def forward(self, x: Tensor | np.ndarray) -> Tensor:
        """x (..., in) -> (..., out): x W + b + scaling (x A) B, W = dequantized_weight() (not kept)."""
        ### BEGIN SOLUTION
        if not isinstance(x, Tensor):
            x = Tensor(np.asarray(x, np.float32))
        y = frozen_linear(x, self.dequantized_weight(), self.bias)
        return y + ((x @ self.lora_A) @ self.lora_B) * self.scaling
        ### END SOLUTION

    def __repr__(self) -> str:
        return f"QLoRALinear({self.in_features}, {self.out_features}, r={self.r}, int4 groups of {self.group_size})"

# %% tags=["check"]
check("19.3")

# %% [markdown]
# QLoRA against LoRA on the same task: the bytes of the frozen Linear weights, the loss of the 4-bit
# base before any training (what quantisation costs), and after training adapters on it by the
# recipe above (shipped, or trained here when `TRAIN` is set; `MINITORCH_SMALL=1` trains a few steps).

# %% tags=["demo"]
qlora_model = add_lora(tiny, r=meta["qlora"]["r"], lora_alpha=meta["qlora"]["lora_alpha"], layer=QLoRALinear)
float_bytes = sum(layer.weight.nbytes for layer in lora_layers(lora_model).values())
int4_bytes = sum(layer.weight_bytes() for layer in lora_layers(qlora_model).values())
q_base = evaluate_loss(qlora_model, code_val, EVAL), evaluate_loss(qlora_model, pydoc_val, EVAL)
if TRAIN or SMALL:
    finetune(qlora_model, code_train, STEPS, params=lora_parameters(qlora_model), lr=3e-3, **RECIPE)
    print(f"QLoRA: trained {STEPS} steps here")
else:
    load_adapter_arrays(qlora_model, runs["qlora"])
    print(f"QLoRA: loaded the shipped adapters ({meta['qlora']['steps']} steps)")
q_after = evaluate_loss(qlora_model, code_val, EVAL), evaluate_loss(qlora_model, pydoc_val, EVAL)
print(f"frozen Linear weights: float32 {float_bytes / 1e3:.1f} kB, int4 groups of 64 {int4_bytes / 1e3:.1f} kB "
      f"({int4_bytes / float_bytes:.3f} of float32; adapters {sum(p.data.nbytes for p in lora_parameters(qlora_model)) / 1e3:.1f} kB)")
print(f"4-bit base, no adapter training: Python source {q_base[0]:.3f}, help pages {q_base[1]:.3f} "
      f"(float base: {results['base']['code']:.3f}, {results['base']['pydoc']:.3f})")
print(f"QLoRA after training:            Python source {q_after[0]:.3f}, help pages {q_after[1]:.3f} "
      f"(LoRA: {results['LoRA r=8']['code']:.3f}, {results['LoRA r=8']['pydoc']:.3f}); recorded: {meta['qlora']['losses']}")

# %% [markdown]
# The 4-bit base costs some loss before any training (the cell prints it against the float base),
# and adapters trained on it land close to LoRA's on the float base: the adapters learn around the
# quantisation error as well as the task, which is QLoRA's finding at 65B. The frozen weights take a
# seventh of their float32 bytes (4 bits, plus a float32 scale and a one-byte zero point per 64).

# %% [markdown]
# ## 4. Serving many adapters in one batch
#
# A service that fine-tunes one base model for many customers ends up with many adapters. Merged,
# each is a full copy of the model: N adapters take N times the memory, and requests for different
# adapters cannot share a batch, so each model serves a fraction of the traffic at a small batch
# size, where decoding is memory-bound and slow per token (lesson 15). Unmerged, one copy of the base
# weights serves every request: each step multiplies all the step's tokens by W once, then adds each
# token's own low-rank update. That second part is the new kernel: the tokens of a step grouped by
# adapter, and for each adapter present two small products, `(x_rows A_a) B_a` (Punica's SGMV,
# "segmented gather matrix-vector"; S-LoRA also pages the adapters in and out of GPU memory).

# %% [markdown]
# Given: the engine. `AdapterEngine` is lesson 15's `Engine` with one method replaced, `_forward`,
# the one that runs the model over a step's plan: it runs `lora_paged_forward`, lesson 11's
# `paged_forward` with every adapted Linear's output plus `lora_fn` (your `lora_batched`, exercise
# 19.4 below) over the step's tokens, each token tagged with its request's adapter. `add_request` takes an `adapter`
# name. The prefix cache is off: a cached block holds keys and values computed through one adapter,
# so a prompt's blocks could only be shared between requests of the same adapter (vLLM keys its
# prefix cache by the adapter for that reason).

# %%
#| export
#| given
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

# %% [markdown]
# **Exercise 19.4.** Write `lora_batched`: x (N, in), the adapters stacked as A (n_adapters, in, r),
# B (n_adapters, r, out), scales (n_adapters,), and `adapter_of_row` (N,), one per row, -1 for a row
# with no adapter (the base model). Row n gets `scales[a] * (x[n] A[a]) B[a]`, a = adapter_of_row[n];
# rows with -1 get zeros (careful: `A[-1]` is the last adapter). Do the products through `matmul`,
# two calls per adapter that has rows and none for the others (the tests count them and their
# multiply-adds), not one per row. The result is (N, out) in `np.result_type(x, A, B)`; an id outside
# [-1, n_adapters) is a ValueError naming `adapter_of_row`.

# %%
#| export
#| exercise 19.4
def lora_batched(x: np.ndarray, A: np.ndarray, B: np.ndarray, scales: np.ndarray, adapter_of_row: np.ndarray,
                 matmul: Callable | None = None) -> np.ndarray:
    """The low-rank updates of a batch whose rows use different adapters: row n gets scales[a] *
    (x[n] @ A[a]) @ B[a], a = adapter_of_row[n], or zeros where a = -1. x (N, in); A (n_adapters, in, r);
    B (n_adapters, r, out); scales (n_adapters,); adapter_of_row (N,) ints in [-1, n_adapters). Rows are
    grouped by adapter: two matmul calls (default np.matmul) per adapter present. Returns (N, out)
    in np.result_type(x, A, B)."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("19.4")

# %% [markdown]
# First what it does: one `AdapterEngine` holding the code adapter trained above, serving the same
# prompts with it and without it in the same batches. Each request's tokens must be exactly those of
# lesson 11's `generate` on the base weights with that request's adapter merged in (or none): the
# cell checks it, in float64, and prints both texts.

# %% tags=["demo"]
from minitorch.kv_cache import generate as generate_np
from minitorch.kv_cache import gpt_weights

W64 = gpt_weights(tiny, np.float64)
code_adapter = model_adapter(lora_model)
engine = AdapterEngine(W64, {"code": code_adapter}, lora_fn=lora_batched, num_blocks=64, max_running=8)
prompts = [tok.encode(t) for t in ("def ", "    return ", "The ")]
handles = [(p, a, engine.add_request(p, 40 if not SMALL else 12, adapter=a)) for p in prompts for a in (None, "code")]
engine.run_until_idle()
for p, a, h in handles:
    Wm = W64 if a is None else merge_adapter_weights(W64, code_adapter)
    same = list(h.output) == list(generate_np(Wm, p, len(h.output)))
    print(f"{'base' if a is None else 'code':>4} (as its merged model: {same}): {tok.decode(p)!r} -> {tok.decode(h.output)!r}")

# %% [markdown]
# Then what it costs. The tiny GPT's weights (443 kB in float32) sit in this CPU's caches, so a
# decode step's time grows with its batch and batching buys little; real models are bound by reading
# their weights from memory, and there batching is nearly free. So the timing uses a model of GPT-2
# small's width (random weights: the time does not depend on their values), 4 layers of width 512,
# 50 MB in float32: 32 requests of 16 new tokens (greedy), spread over 4 adapters of rank 8 on every
# Linear, served (a) by one `AdapterEngine` holding all four, and (b) by one engine per adapter with
# that adapter merged into its weights, run one after the other, each with its share of the requests.
# Both run the same reference path (the fused decode of lesson 15 is off in both), so the difference
# is batching. The cell checks that both produce the same tokens, and prints the time of each (the
# better of two runs), the tokens per second and the weight memory, with the machine's load.

# %% tags=["demo"]
from minitorch.bench import load_report
from minitorch.kv_cache import random_gpt_weights

N_ADAPTERS, WIDTH, LAYERS = 4, (256 if SMALL else 512), (2 if SMALL else 4)
N_REQ, NEW = (8, 6) if SMALL else (32, 16)
Wbig = random_gpt_weights(vocab_size=tok.vocab_size, block_size=64, n_layer=LAYERS, n_head=8, n_embd=WIDTH, seed=0,
                          dtype=np.float32)
rng = np.random.default_rng(0)
linears = [f"blocks.{i}.{t}" for i in range(LAYERS) for t in LORA_TARGETS]
adapters = {f"adapter{a}": {name: ((rng.standard_normal((Wbig.params[name + ".weight"].shape[0], 8)) / np.sqrt(WIDTH)).astype(np.float32),
                                   (rng.standard_normal((8, Wbig.params[name + ".weight"].shape[1])) * 0.05).astype(np.float32), 2.0)
                            for name in linears} for a in range(N_ADAPTERS)}
names = list(adapters)
starts = [rng.integers(0, tok.vocab_size, 8) for _ in range(6)]
requests = [(starts[i % len(starts)], names[i % N_ADAPTERS]) for i in range(N_REQ)]
ENGINE = dict(num_blocks=512, block_size=8, max_running=64, max_num_batched_tokens=512)


def serve_all(engine, reqs, tagged):
    t0 = time.perf_counter()
    hs = [engine.add_request(p, NEW, **({"adapter": a} if tagged else {})) for p, a in reqs]
    engine.run_until_idle()
    return time.perf_counter() - t0, [list(h.output) for h in hs]


def one_engine():
    return serve_all(AdapterEngine(Wbig, adapters, lora_fn=lora_batched, **ENGINE), requests, True)


def merged_engines():
    total, outs = 0.0, {}
    for name in names:
        engine = Engine(merge_adapter_weights(Wbig, adapters[name]), decode="reference", prefix_caching=False, **ENGINE)
        t, o = serve_all(engine, [r for r in requests if r[1] == name], False)
        total, outs[name] = total + t, iter(o)
    return total, [next(outs[a]) for _, a in requests]


print(load_report())
(t_multi, out_multi), (t_merged, out_merged) = one_engine(), merged_engines()
t_multi, t_merged = min(t_multi, one_engine()[0]), min(t_merged, merged_engines()[0])
tokens = N_REQ * NEW
w_bytes = sum(v.nbytes for v in Wbig.params.values())
a_bytes = sum(a.nbytes + b.nbytes for ad in adapters.values() for a, b, _ in ad.values())
print(f"{N_REQ} requests x {NEW} tokens over {N_ADAPTERS} adapters, width {WIDTH}, {LAYERS} layers; "
      f"same tokens both ways: {out_multi == out_merged}")
print(f"one engine, all adapters in each batch: {t_multi:.2f} s ({tokens / t_multi:.0f} tokens/s); weights "
      f"{(w_bytes + a_bytes) / 1e6:.1f} MB (base {w_bytes / 1e6:.1f} MB + adapters {a_bytes / 1e6:.2f} MB)")
print(f"one merged engine per adapter, in turn: {t_merged:.2f} s ({tokens / t_merged:.0f} tokens/s); weights "
      f"{N_ADAPTERS * w_bytes / 1e6:.1f} MB; {t_merged / t_multi:.2f}x the time of one engine")

# %% [markdown]
# One engine for all adapters holds one model plus small adapters instead of N models, and runs a
# quarter as many steps, each a little dearer (the gathered products); the cell printed what that
# came to here. The extra products are cheap because r is small: per token and Linear,
# `r (in + out)` multiply-adds against `in x out` for the base. On a GPU the same trade holds with
# more at stake (Punica reports up to 12x the throughput of serving the adapters as separate
# models), and `make bench` measures it at 2, 4 and 8 adapters (`benchmarks/bench_sparse.py`).

# %% [markdown]
# ## 5. Distillation: a small model trained on a big one's predictions
#
# The last way to a cheaper model is to train a small one to imitate a big one. A language model's
# next-character distribution holds more than the character that came: that `(` is likely after
# `print` and `[` possible says something about the text that the single target does not. Hinton et
# al. (2015) train the student on the teacher's distribution **softened** by a temperature T,
# `p_T = softmax(z_teacher / T)`, which lifts the small probabilities, with the loss
#
# $$L = \alpha\, T^2\, \mathrm{KL}(p_T \,\Vert\, q_T) + (1 - \alpha)\, \mathrm{CE}(z_{student}, y), \qquad q_T = \mathrm{softmax}(z_{student} / T).$$
#
# Two details matter. The KL runs **from the teacher to the student**, `sum p_T (log p_T - log q_T)`:
# the student must cover everything the teacher thinks possible (the other direction would let it
# put its mass on one likely character and ignore the rest). And the **T^2**: the gradient of the KL
# term with respect to the student's logits is `(q_T - p_T) / T`, and at high temperature
# `q_T - p_T` itself shrinks like 1/T, so the gradient shrinks like 1/T^2 (Hinton et al.);
# multiplying by T^2 keeps it comparable to the hard-label term's whatever T, so alpha means the
# same at every temperature.
#
# **Exercise 19.5.** Write `distillation_loss` for logits (N, V): the student's a Tensor, the
# teacher's an array (no gradient), targets (N,) (may be None when alpha = 1). The KL is summed over
# the vocabulary and averaged over the N rows, in nats; the result keeps the student's dtype.
# ValueErrors: the teacher's shape not the student's (`teacher_logits`), targets missing while
# alpha < 1 (`targets`).

# %%
#| export
#| exercise 19.5
def distillation_loss(student_logits: Tensor, teacher_logits: np.ndarray, targets: np.ndarray | None = None,
                      temperature: float = 2.0, alpha: float = 0.5) -> Tensor:
    """Hinton et al.'s loss: alpha * T^2 * KL(p_T || q_T) + (1 - alpha) * cross_entropy(student, targets),
    p_T = softmax(teacher_logits / T), q_T = softmax(student_logits / T), T = temperature; the KL summed
    over the vocabulary and averaged over the rows. student_logits (N, V) Tensor; teacher_logits (N, V)
    array; targets (N,) ints or None (alpha == 1 only). A one-element Tensor in the student's dtype."""
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% tags=["check"]
check("19.5")

# %%
#| export
#| given
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

# %% [markdown]
# What the temperature does to the teacher's distribution: the tiny GPT's next-character
# probabilities after a prompt, at temperature T. At T = 1 a few characters have all the mass; as T
# grows the rest become visible, and that is what the student learns from. The figure's second
# panel is the size of the KL gradient on the student's logits for a student that has not learnt
# yet (uniform), with and without the T^2.

# %% tags=["demo"]
from course.live import live

with no_grad():
    ctx = tok.encode("    def __init__(self")
    teacher_last = tiny(ctx[None])[0].numpy()[0, -1].astype(np.float64)
top = np.argsort(-teacher_last)[:24]


def draw_temperature(T: float = 2.0):
    z = teacher_last / T
    p = np.exp(z - z.max())
    p /= p.sum()
    q = np.full_like(p, 1.0 / p.size)
    grad = np.abs(q - p).sum() / T  # |d KL / d z_student|_1 without T^2
    temps = np.linspace(0.5, 8, 60)
    g_all = []
    for tt in temps:
        zz = teacher_last / tt
        pp = np.exp(zz - zz.max())
        pp /= pp.sum()
        g_all.append(np.abs(q - pp).sum() / tt)
    g_all = np.array(g_all)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw=dict(width_ratios=[2, 1], wspace=0.3))
    a1.bar(range(len(top)), p[top], color="C0")
    a1.set_xticks(range(len(top)), [repr(tok.decode([i]))[1:-1] or " " for i in top], fontsize=8)
    a1.set(ylim=(0, 1), ylabel="probability", title=f"teacher after '    def __init__(self', T = {T:.1f}")
    a2.plot(temps, g_all, label="KL gradient")
    a2.plot(temps, g_all * temps ** 2, label="x T^2")
    a2.axvline(T, color="gray", ls=":")
    a2.set(xlabel="T", yscale="log", title="gradient size (L1), uniform student")
    a2.legend(fontsize=8)
    return fig


live(draw_temperature, T=(0.5, 8.0, 0.1))

# %% [markdown]
# The experiment: students of three sizes (one layer; 16, 32 and 48 wide; 2 heads), each trained
# for the same steps on the help pages three ways: on the text alone (cross-entropy: alpha = 0), and
# on the tiny GPT's predictions alone (alpha = 1) at T = 1 and at T = 2; then evaluated by
# cross-entropy on the held-out help pages. As with the adapters, `TRAIN` retrains (many minutes)
# and otherwise the recorded results from `data/tiny_gpt_lora.json` are plotted;
# `MINITORCH_SMALL=1` trains the smallest student a few steps each way here (the loop working, not
# the result).

# %% tags=["demo"]
from minitorch.gpt import GPTConfig

pydoc_train = split_ids(tok.encode(load_corpus()))[0]
DISTILL = meta["distill"]


def distill_loss_fn(teacher, T, alpha):
    """finetune's loss_fn for a student: your distillation_loss against the teacher's logits."""
    def loss_fn(model, x, y):
        with no_grad():
            t_logits = teacher(x)[0].numpy()
        s_logits, _ = model(x)
        v = s_logits.shape[-1]
        return distillation_loss(s_logits.reshape(-1, v), t_logits.reshape(-1, v), y.reshape(-1), T, alpha)
    return loss_fn


if TRAIN or SMALL:
    sizes = DISTILL["sizes"] if not SMALL else DISTILL["sizes"][:1]
    steps = DISTILL["steps"] if not SMALL else 4
    for width in sizes:
        cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=width)
        for kind, how in DISTILL["kinds"].items():
            student = GPT(cfg, seed=0)
            loss_fn = None if how["alpha"] == 0 else distill_loss_fn(tiny, how["temperature"], how["alpha"])
            finetune(student, pydoc_train, steps, lr=DISTILL["lr"], batch_size=16, seed=0, loss_fn=loss_fn)
            print(f"trained here: width {width}, {kind:>14}: {student.num_parameters():,} parameters, {steps} steps, "
                  f"val loss {evaluate_loss(student, pydoc_val, EVAL):.3f}")
fig, ax = plt.subplots(figsize=(6.5, 3.6))
for (kind, rec), marker in zip(DISTILL["results"].items(), "osd"):
    ax.plot(rec["params"], rec["val_loss"], marker + "-", label=kind)
    print(f"recorded, {kind:>14}: " + ", ".join(f"{n:,} params -> {v:.3f}" for n, v in zip(rec["params"], rec["val_loss"])))
ax.axhline(DISTILL["teacher_val_loss"], color="k", ls="--", lw=1, label=f"teacher ({DISTILL['teacher_params']:,} params)")
ax.set(xscale="log", xlabel="student parameters",
       ylabel=f"val loss, help pages ({DISTILL['eval_windows']} windows)",
       title=f"{DISTILL['steps']} steps of {DISTILL['batch_size']} windows each (recorded)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Read the recorded lines (each point one training run of the same steps and batches): at T = 1 the
# distilled student beats the one trained on the text at every size, and by more the larger it is;
# at T = 2 it does worse except at the largest size. One reading: a student this small cannot match
# a softened distribution everywhere, and at T = 2 the loss spends its capacity on the tail of
# unlikely characters, which the evaluation at T = 1 hardly weighs. Which temperature pays is a question for
# each pair of models; Hinton et al. used T from 2 to 20 on models far larger than these.

# %% [markdown]
# ## Where to go from here
#
# - **Other adapters.** DoRA (Liu et al. 2024) splits each weight into a magnitude and a direction
#   and adapts the direction with LoRA; prefix tuning and prompt tuning (Li and Liang 2021; Lester et
#   al. 2021) learn inputs instead of weights; IA3 learns per-channel scales. PEFT implements all of
#   them behind the same `get_peft_model`.
# - **Which layers, which rank.** Hu et al. adapted only q and v; QLoRA found that adapting every
#   Linear matters more than the rank. LoRA learns less than full fine-tuning on hard new domains and
#   forgets less of the old one (Biderman et al. 2024): section 2's two columns of losses are that
#   trade in small.
# - **Serving.** vLLM and SGLang serve many LoRA adapters with Punica's and S-LoRA's kernels; S-LoRA
#   keeps thousands of adapters in host memory and pages them onto the GPU as requests arrive.
# - **Distilling LLMs.** DistilBERT (Sanh et al. 2019) halved BERT; MiniLLM (Gu et al. 2024) argues
#   for the *reverse* KL when the student is much smaller than the teacher, the opposite choice to
#   Hinton's for the same reason read the other way: a small student cannot cover everything, and
#   should not try.
#
# Sources: Hu et al. 2022, "LoRA: low-rank adaptation of large language models"; Dettmers, Pagnoni,
# Holtzman and Zettlemoyer 2023, "QLoRA: efficient finetuning of quantized LLMs"; Chen et al. 2024,
# "Punica: multi-tenant LoRA serving"; Sheng et al. 2024, "S-LoRA: serving thousands of concurrent
# LoRA adapters"; Hinton, Vinyals and Dean 2015, "Distilling the knowledge in a neural network";
# Biderman et al. 2024, "LoRA learns less and forgets less"; Liu et al. 2024, "DoRA"; Sanh et al.
# 2019, "DistilBERT"; Gu et al. 2024, "MiniLLM"; Hugging Face PEFT's documentation (LoRA, QLoRA,
# `merge_and_unload`).

# %%
#| export
#| given
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
