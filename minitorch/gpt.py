# Generated from solutions/09_attention.py by `make build`. Do not edit.
"""minitorch.gpt: a character-level GPT (the shape of nanoGPT) trained on Python's own help
text; its corpus, tokenizer, layers, training loop, evaluation and the shipped checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import minitorch
from minitorch.autograd import Tensor, no_grad
from minitorch.checks import check_int, check_number, describe
from minitorch.nn import Linear, Module, Parameter, cross_entropy
from minitorch.optim import Adam

if __name__ == "minitorch.gpt":
    # The package takes attention from minitorch.attention. In the lesson notebook this import
    # is skipped, so the model runs the attention functions written above it.
    from minitorch.attention import attention, causal_mask, check_size, flash_attention, merge_heads, split_heads


CORPUS_SHA256 = "37d06970fc926e60c16dff401e441b84752446a36b6b64516c229fdec77e992c"  # Python 3.11.7's pages


def _data_dir() -> Path:
    """Where the shipped data lives: $MINITORCH_DATA if set; else data/ beside the minitorch package
    (a checkout of the course); else minitorch/_data (where a wheel of the course installs it)."""
    if os.environ.get("MINITORCH_DATA"):
        return Path(os.environ["MINITORCH_DATA"])
    here = Path(minitorch.__file__).resolve().parent
    for folder in (here.parent / "data", here / "_data"):
        if (folder / "tiny_gpt.json").exists():
            return folder
    return here.parent / "data"


DATA_DIR = _data_dir()
CORPUS = DATA_DIR / "pydoc_topics.txt.gz"  # the text, its licence in pydoc_topics.NOTICE.md


class CorpusMismatch(RuntimeError):
    """The corpus read is not the text the shipped model was trained on."""


def corpus_sha256(text: str) -> str:
    """SHA-256 (hex) of the UTF-8 bytes of `text`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def pydoc_corpus() -> str:
    """This Python's own help pages: every value of `pydoc_data.topics.topics` in sorted key order,
    concatenated. Python 3.11.7's is the shipped corpus; other releases give other text."""
    from pydoc_data import topics

    return "".join(topics.topics[key] for key in sorted(topics.topics))


def load_corpus(check: bool = True) -> str:
    """The training text: Python 3.11.7's help pages (`pydoc_corpus()` on that Python), read from
    data/pydoc_topics.txt.gz on every Python. About 465k characters; nothing is downloaded.

    With check=True raises CorpusMismatch if its SHA-256 is not CORPUS_SHA256 (the shipped
    checkpoint's recorded losses hold only for that text)."""
    import gzip

    if not CORPUS.exists():
        raise FileNotFoundError(f"no corpus file {CORPUS} (set MINITORCH_DATA to the folder holding "
                                "pydoc_topics.txt.gz, tiny_gpt.npz and tiny_gpt.json)")
    text = gzip.decompress(CORPUS.read_bytes()).decode("utf-8")
    digest = corpus_sha256(text)
    if check and digest != CORPUS_SHA256:
        raise CorpusMismatch(
            f"{CORPUS} has SHA-256 {digest[:16]}..., not the {CORPUS_SHA256[:16]}... of the text the shipped "
            "model was trained and evaluated on (Python 3.11.7's help pages). Restore the file, or "
            "load_corpus(check=False) to use this text (recorded losses will differ).")
    return text


class CharTokenizer:
    """Characters <-> integer ids. `vocab` is a string of distinct characters; a character's id is
    its index in `vocab`. CharTokenizer.from_text(text) uses the sorted distinct characters of text."""

    def __init__(self, vocab: str):
        if len(set(vocab)) != len(vocab):
            raise ValueError("CharTokenizer: the vocabulary has repeated characters")
        self.vocab = vocab
        self.stoi = {c: i for i, c in enumerate(vocab)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """int64 array (len(text),) of ids. ValueError naming the first unknown character."""
        try:
            return np.fromiter((self.stoi[c] for c in text), dtype=np.int64, count=len(text))
        except KeyError as exc:
            pos = next(i for i, c in enumerate(text) if c not in self.stoi)
            raise ValueError(f"encode: character {exc.args[0]!r} at position {pos} is not in the "
                             f"vocabulary of {self.vocab_size} characters") from None

    def decode(self, ids: Any) -> str:
        """The string of the ids in a 1-D integer array or list (an empty one gives "")."""
        arr = np.asarray(ids) if isinstance(ids, (list, tuple, range, np.ndarray)) else None
        if arr is None or (arr.size and arr.dtype.kind not in "iu") or arr.ndim != 1:
            raise (TypeError if arr is None or arr.ndim == 1 else ValueError)(
                f"decode: ids must be a 1-D array or list of integer ids, got {describe(ids)}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"decode: ids must lie in [0, {self.vocab_size}), got values {arr.min()}..{arr.max()}")
        return "".join(self.vocab[i] for i in arr.tolist())

    def __repr__(self) -> str:
        return f"CharTokenizer({self.vocab_size} characters)"


def _check_vocab_ids(what: str, name: str, ids: np.ndarray, vocab_size: int) -> None:
    """ValueError naming `what`, `name` and the values unless every id lies in [0, vocab_size)."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{what}: {name} must hold ids in [0, vocab_size={vocab_size}), got values "
                         f"{ids.min()}..{ids.max()}")


VAL_FRACTION = 0.1


def split_ids(ids: np.ndarray, val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """The fixed split: (first 1 - val_fraction of the ids, the rest). Views, no copy.
    ids: a 1-D integer array; val_fraction in [0, 1]."""
    n_train = int(len(ids) * (1.0 - val_fraction))
    return ids[:n_train], ids[n_train:]


def get_batch(ids: np.ndarray, batch_size: int, block_size: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """B random windows: x (B, T) int64 = ids[s : s + T], y (B, T) = ids[s + 1 : s + T + 1], for B
    start offsets s drawn from `rng`. y[b, t] is the character that follows x[b, :t + 1].
    ids: a 1-D integer array; batch_size (B) and block_size (T) >= 1."""
    if len(ids) <= block_size:
        raise ValueError(f"get_batch: need more than block_size={block_size} ids, got {len(ids)}")
    starts = rng.integers(0, len(ids) - block_size, size=batch_size)
    offsets = starts[:, None] + np.arange(block_size)[None, :]
    return ids[offsets].astype(np.int64), ids[offsets + 1].astype(np.int64)


def eval_windows(ids: np.ndarray, block_size: int, n_windows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive non-overlapping windows from the start of `ids`: x (W, T) = ids[wT : wT + T],
    y = ids[wT + 1 : wT + T + 1]; all that fit, or the first n_windows. Deterministic."""
    block_size = check_size("eval_windows", "block_size", block_size, 1)
    if n_windows is not None:
        n_windows = check_size("eval_windows", "n_windows", n_windows, 1)
    available = (len(ids) - 1) // block_size
    w = available if n_windows is None else min(int(n_windows), available)
    starts = np.arange(w) * block_size
    offsets = starts[:, None] + np.arange(block_size)[None, :]
    return ids[offsets].astype(np.int64), ids[offsets + 1].astype(np.int64)


def bigram_loss(train_ids: np.ndarray, eval_ids: np.ndarray, vocab_size: int, alpha: float = 0.1) -> float:
    """Mean cross-entropy (nats/char) on eval_ids of a bigram model p(next | current) estimated by
    counting pairs in train_ids, with add-alpha smoothing (alpha > 0). Ids lie in [0, vocab_size);
    eval_ids holds at least 2."""
    for name, ids in (("train_ids", train_ids), ("eval_ids", eval_ids)):
        _check_vocab_ids("bigram_loss", name, ids, vocab_size)
    if len(eval_ids) < 2:
        raise ValueError(f"bigram_loss: eval_ids must hold at least 2 ids (one pair), got {len(eval_ids)}")
    counts = np.full((vocab_size, vocab_size), alpha)
    np.add.at(counts, (train_ids[:-1], train_ids[1:]), 1.0)
    logp = np.log(counts / counts.sum(axis=1, keepdims=True))
    return float(-logp[eval_ids[:-1], eval_ids[1:]].mean())


def _check_layer_norm_arrays(x: Any, weight: Any, bias: Any, eps: Any, what: str) -> None:
    """The NumPy LayerNorm's arguments: floating arrays x (..., C), weight and bias (C,), eps > 0.
    Called on the inference models' inner loop (lesson 11): the common case costs a few attribute reads."""
    for name, a in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
            raise TypeError(f"{what}: {name} must be a floating NumPy array, got {describe(a)} ({np.ndim(a)} axes)")
    if eps.__class__ is not float or not 0.0 < eps < math.inf:
        check_number(what, "eps", eps)
        if not eps > 0:
            raise ValueError(f"{what}: eps must be a finite number > 0, got {eps}")
    c = x.shape[-1] if x.ndim else None
    if c is None or weight.shape != (c,) or bias.shape != (c,):
        raise ValueError(f"{what}: x {x.shape} needs weight and bias of shape ({c},), got {weight.shape} and "
                         f"{bias.shape}")


def _check_layer_norm(x: Any, weight: Any, bias: Any, what: str = "layer_norm") -> None:
    shape = tuple(np.shape(x))
    c = shape[-1] if shape else None
    if not shape or tuple(np.shape(weight)) != (c,) or tuple(np.shape(bias)) != (c,):
        raise ValueError(f"{what}: x {shape} needs weight and bias of shape ({c},), got "
                         f"{tuple(np.shape(weight))} and {tuple(np.shape(bias))}")


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last axis as one differentiable node; it saves xhat and rstd only.
    x (..., C) autograd Tensor; weight, bias (C,). Returns a Tensor (..., C) of x's dtype."""
    _check_layer_norm(x, weight, bias)
    y, xhat, rstd = layer_norm_forward(x.data, weight.data, bias.data, eps)
    out = x._new(y.astype(x.dtype, copy=False))
    return x._record(out, (x, weight, bias), lambda g: layer_norm_backward(g, xhat, rstd, weight.data),
                     "layer_norm")


def layer_norm_np(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """LayerNorm in plain NumPy (what the model computes), in x's dtype. Its arguments are checked
    by layer_norm_forward (floating arrays x (..., C), weight and bias (C,), eps > 0)."""
    return layer_norm_forward(x, weight, bias, eps)[0]


GELU_C = math.sqrt(2.0 / math.pi)


def gelu_np(x: np.ndarray) -> np.ndarray:
    """GELU, tanh form (Hendrycks and Gimpel, 2016; GPT-2's): 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * x ** 3)))


def gelu(x: Tensor) -> Tensor:
    """gelu_np as one differentiable node (saves x and the tanh). x: a floating Tensor."""
    a = x.data
    if a.dtype.kind != "f":
        raise TypeError(f"gelu: x must be a floating Tensor, got {a.dtype} (convert it with .astype first)")
    t = np.tanh(GELU_C * (a + 0.044715 * a ** 3))
    out = x._new((0.5 * a * (1.0 + t)).astype(a.dtype, copy=False))

    def vjp(g: np.ndarray) -> tuple[np.ndarray]:
        dt = (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * a * a)
        return (g * (0.5 * (1.0 + t) + 0.5 * a * dt),)

    return x._record(out, (x,), vjp, "gelu")


def layer_norm_forward(x: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                       eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LayerNorm over the last axis: y = (x - mean) / sqrt(var + eps) * weight + bias (biased var).

    x (..., C); weight, bias (C,). Returns (y (..., C), xhat (..., C) the normalised x,
    rstd (..., 1) = 1 / sqrt(var + eps)), all in x's dtype."""
    _check_layer_norm_arrays(x, weight, bias, eps, "layer_norm_forward")
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(axis=-1, keepdims=True)
    rstd = (1.0 / np.sqrt(var + eps)).astype(x.dtype, copy=False)
    xhat = centered * rstd
    return xhat * weight + bias, xhat, rstd


def layer_norm_backward(g: np.ndarray, xhat: np.ndarray, rstd: np.ndarray,
                        weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of LayerNorm from the upstream gradient g (..., C) and the forward's saved xhat
    (..., C) and rstd (..., 1). Returns (dx (..., C), dweight (C,), dbias (C,))."""
    shapes = tuple(np.shape(a) for a in (g, xhat, rstd, weight))
    if (len(shapes[0]) == 0 or shapes[1] != shapes[0] or shapes[2] != shapes[0][:-1] + (1,)
            or shapes[3] != shapes[0][-1:]):
        raise ValueError(f"layer_norm_backward: g, xhat, rstd, weight must be (..., C), (..., C), (..., 1), (C,); "
                         f"got g {shapes[0]}, xhat {shapes[1]}, rstd {shapes[2]}, weight {shapes[3]}")
    lead = tuple(range(g.ndim - 1))
    dweight = (g * xhat).sum(axis=lead)
    dbias = g.sum(axis=lead)
    gw = g * weight
    dx = rstd * (gw - gw.mean(axis=-1, keepdims=True) - xhat * (gw * xhat).mean(axis=-1, keepdims=True))
    return dx, dweight, dbias


ATTENTION_IMPLS = ("reference", "flash")


@dataclass
class GPTConfig:
    """The model's shape. block_size: the longest context (positions 0..block_size-1); the MLP is
    4 * n_embd wide; n_embd must be divisible by n_head. attention: "reference" (attention(),
    exercise 9.1) or "flash" (flash_attention, exercise 9.7): the same function, computed differently."""

    vocab_size: int = 103
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    ln_eps: float = 1e-5
    attention: str = "reference"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            setattr(self, name, check_int("GPTConfig", name, getattr(self, name), 1))
        self.ln_eps = check_number("GPTConfig", "ln_eps", self.ln_eps, 0.0)
        if self.ln_eps <= 0:
            raise ValueError(f"GPTConfig: ln_eps must be > 0, got {self.ln_eps}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"GPTConfig: attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class Embedding(Module):
    """A table of num x dim learned vectors; weight ~ N(0, 0.02^2), float32.
    forward(idx) with idx an integer array (...) returns weight[idx], a Tensor (..., dim)."""

    def __init__(self, num: int, dim: int, rng: np.random.Generator):
        self.weight = Parameter((rng.standard_normal((num, dim)) * 0.02).astype(np.float32))

    def forward(self, idx: Any) -> Tensor:
        given, idx = idx, np.asarray(idx) if not isinstance(idx, (str, bytes)) else np.asarray(0.5)
        n = self.weight.shape[0]
        if idx.dtype.kind not in "iu":
            raise TypeError(f"Embedding({n}, {self.weight.shape[1]}): idx must be integer ids in [0, {n}), got "
                            f"{describe(given)}")
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError(f"Embedding({n}, {self.weight.shape[1]}): idx must be integer ids in [0, {n}), got "
                             f"dtype {idx.dtype}, values {idx.min()}..{idx.max()}")
        return self.weight[idx]


class LayerNorm(Module):
    """layer_norm with a learned weight (ones) and bias (zeros) of shape (dim,), float32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        self.weight = Parameter(np.ones(dim, np.float32))
        self.bias = Parameter(np.zeros(dim, np.float32))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class MLP(Module):
    """x (..., C) -> proj(gelu(fc(x))): fc Linear(C, 4C), proj Linear(4C, C)."""

    def __init__(self, config: GPTConfig, rng: np.random.Generator):
        c = config.n_embd
        self.fc = Linear(c, 4 * c, rng=rng, init=0.02)
        self.proj = Linear(4 * c, c, rng=rng, init=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(gelu(self.fc(x)))


EVAL_WINDOWS = 64  # the fixed validation subset the tests use: the first 64 windows (4096 characters)


def evaluate_loss(model: Module, ids: np.ndarray, n_windows: int | None = None, batch_size: int = 64,
                  progress: bool = False) -> float:
    """Mean cross-entropy (nats per character) of `model` predicting ids over eval_windows(ids,
    block_size, n_windows), in eval mode without gradients. Deterministic. progress=True shows a
    progress bar over the batches (all 726 validation windows take tens of seconds)."""
    from tqdm.auto import tqdm

    _check_vocab_ids("evaluate_loss", "ids", ids, model.config.vocab_size)
    x, y = eval_windows(ids, model.config.block_size, n_windows)
    if len(x) == 0:
        raise ValueError(f"evaluate_loss: need more than block_size={model.config.block_size} ids, got {len(ids)}")
    was_training = model.training
    model.eval()
    total = 0.0
    with no_grad():
        for start in tqdm(range(0, len(x), batch_size), disable=not progress, desc="evaluating", unit="batch"):
            _, loss = model(x[start:start + batch_size], y[start:start + batch_size])
            total += loss.item() * len(x[start:start + batch_size])
    model.train(was_training)
    return total / len(x)


TINY_GPT = DATA_DIR / "tiny_gpt"  # tiny_gpt.npz (weights) + tiny_gpt.json (config, corpus hash, losses)


def save_checkpoint(model: "GPT", path: str | Path, **meta: Any) -> None:
    """Write path.npz (the state dict: name -> float32 array) and path.json ({"config": ..., **meta})."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path.with_suffix(".npz"), **model.state_dict())
    info = {"config": asdict(model.config), **meta}
    path.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")


def load_checkpoint(path: str | Path, attention: str = "reference") -> tuple["GPT", dict[str, Any]]:
    """(model in eval mode, meta dict) from path.npz and path.json written by save_checkpoint."""
    path = Path(path)
    for suffix in (".npz", ".json"):
        if not path.with_suffix(suffix).exists():
            raise FileNotFoundError(f"no checkpoint file {path.with_suffix(suffix)} (set MINITORCH_DATA to the "
                                    "folder holding tiny_gpt.npz and tiny_gpt.json)")
    meta = json.loads(path.with_suffix(".json").read_text())
    config = GPTConfig(**{**meta["config"], "attention": attention})
    model = GPT(config)
    with np.load(path.with_suffix(".npz")) as arrays:
        model.load_state_dict({name: arrays[name] for name in arrays.files})
    model.eval()
    return model, meta


def load_tiny_gpt(attention: str = "reference") -> tuple["GPT", CharTokenizer]:
    """The shipped model (data/tiny_gpt.*) in eval mode and its tokenizer. Its json (tiny_gpt_meta())
    records the config, the corpus SHA-256, the vocabulary and the losses it reached."""
    model, meta = load_checkpoint(TINY_GPT, attention)
    return model, CharTokenizer(meta["vocab"])


def tiny_gpt_meta() -> dict[str, Any]:
    """The shipped checkpoint's json: config, corpus_sha256, vocab, val_loss (all windows),
    val_loss_subset (first eval_windows windows), steps, batch_size, lr, train_cpu_seconds, ..."""
    return json.loads(TINY_GPT.with_suffix(".json").read_text())


class CausalSelfAttention(Module):
    """Multi-head causal self-attention: x (B, T, C) -> (B, T, C). Each of q, k, v, proj is
    Linear(C, C); heads as split_heads; the attention is config.attention's implementation."""

    def __init__(self, config: GPTConfig, rng: np.random.Generator):
        c = config.n_embd
        self.n_head = config.n_head
        self.impl = config.attention
        self.q = Linear(c, c, rng=rng, init=0.02)
        self.k = Linear(c, c, rng=rng, init=0.02)
        self.v = Linear(c, c, rng=rng, init=0.02)
        self.proj = Linear(c, c, rng=rng, init=0.02 / math.sqrt(2 * config.n_layer))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of q (B, H, Tq, hd) over k, v (B, H, Tk, hd) -> (B, H, Tq, hd)."""
        if self.impl == "flash":
            return flash_attention(q, k, v, causal=True)
        return attention(q, k, v, mask=causal_mask(q.shape[-2], k.shape[-2]))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (split_heads(lin(x), self.n_head) for lin in (self.q, self.k, self.v))
        return self.proj(merge_heads(self.attend(q, k, v)))


class Block(Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)). (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig, rng: np.random.Generator):
        self.ln1 = LayerNorm(config.n_embd, config.ln_eps)
        self.attn = CausalSelfAttention(config, rng)
        self.ln2 = LayerNorm(config.n_embd, config.ln_eps)
        self.mlp = MLP(config, rng)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(Module):
    """A decoder-only transformer over token ids. GPT(config, seed=0) draws its initial weights
    from np.random.default_rng(seed). Parameters: see the table in lesson 09 (wte, wpe, blocks.i.*,
    ln_f; the output layer is wte.weight transposed)."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd, rng)
        self.wpe = Embedding(config.block_size, config.n_embd, rng)
        self.blocks = [Block(config, rng) for _ in range(config.n_layer)]
        self.ln_f = LayerNorm(config.n_embd, config.ln_eps)

    def forward(self, idx: Any, targets: Any = None) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) integer ids, T <= block_size. Returns (logits (B, T, V) float32 Tensor, loss):
        loss is None without targets, else the mean cross-entropy (nats) of targets (B, T)."""
        idx = np.asarray(idx)
        if idx.ndim != 2 or not 1 <= idx.shape[1] <= self.config.block_size:
            raise ValueError(f"GPT: idx must have shape (B, T) with 1 <= T <= block_size={self.config.block_size}, "
                             f"got {idx.shape}")
        if targets is not None:
            targets = np.asarray(targets)
            if targets.shape != idx.shape:
                raise ValueError(f"GPT: targets shape {targets.shape} != idx shape {idx.shape}")
        b, t = idx.shape
        x = self.wte(idx) + self.wpe.weight[:t]
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        loss = None
        if targets is not None:
            loss = cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))
        return logits, loss


def lr_schedule(step: int, steps: int, lr: float, warmup: int = 50, min_ratio: float = 0.1) -> float:
    """Learning rate at `step` (0-based) of `steps`: linear warm-up over `warmup` steps, then a
    cosine from lr down to min_ratio * lr at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def train_gpt(model: "GPT", train_ids: np.ndarray, steps: int, batch_size: int = 32, lr: float = 3e-3,
              warmup: int = 50, seed: int = 0, val_ids: np.ndarray | None = None, eval_every: int = 100,
              eval_windows: int | None = EVAL_WINDOWS, progress: bool = True, desc: str = "training") -> dict[str, Any]:
    """Train `model` in place with Adam on random batches (get_batch, np.random.default_rng(seed))
    for `steps` steps, learning rate lr_schedule(step, steps, lr, warmup).

    Returns {"loss": [training loss of each step], "val_step": [...], "val_loss": [...] (every
    eval_every steps and at the end, on the first eval_windows windows of val_ids, if given),
    "seconds": wall time, "cpu_seconds": CPU time of this process}; both times add up the steps
    and evaluations alone, not the progress bar (progress=True, labelled desc) between them."""
    from tqdm.auto import tqdm

    _check_vocab_ids("train_gpt", "train_ids", train_ids, model.config.vocab_size)
    if val_ids is not None:
        _check_vocab_ids("train_gpt", "val_ids", val_ids, model.config.vocab_size)
    rng = np.random.default_rng(seed)
    optimizer = Adam(model.parameters(), lr=lr)
    history: dict[str, Any] = {"loss": [], "val_step": [], "val_loss": []}
    seconds = cpu_seconds = 0.0
    bar = tqdm(range(steps), disable=not progress, desc=desc, unit="step")
    for step in bar:
        t0, c0 = time.perf_counter(), time.process_time()
        optimizer.lr = lr_schedule(step, steps, lr, warmup)
        x, y = get_batch(train_ids, batch_size, model.config.block_size, rng)
        model.train()
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history["loss"].append(loss.item())
        evaluated = val_ids is not None and ((step + 1) % eval_every == 0 or step == steps - 1)
        if evaluated:
            history["val_step"].append(step + 1)
            history["val_loss"].append(evaluate_loss(model, val_ids, eval_windows))
        seconds += time.perf_counter() - t0
        cpu_seconds += time.process_time() - c0
        if evaluated:
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", val=f"{history['val_loss'][-1]:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}")
    history["seconds"] = seconds
    history["cpu_seconds"] = cpu_seconds
    return history


def check_sampling(what: str, max_new_tokens: int | None = None, temperature: float = 0.0,
                   top_k: int | None = None) -> None:
    """Errors naming the argument and its value unless max_new_tokens is an integer >= 0, temperature
    a finite number >= 0 and top_k None or an integer >= 1 (what generate and its kin accept).
    `what` names the function checking (a str)."""
    if what.__class__ is not str:
        raise TypeError(f"check_sampling: what must be a str (the function checking), got {describe(what)}")
    if max_new_tokens is not None:
        check_size(what, "max_new_tokens", max_new_tokens, 0)
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what}: temperature must be a number >= 0, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{what}: temperature must be finite and >= 0 (0 = the most likely id), got {temperature}")
    if top_k is not None:
        check_size(what, "top_k", top_k, 1)


def generate(model: "GPT", idx: Any, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             rng: np.random.Generator | None = None, progress: bool = False) -> np.ndarray:
    """Sample max_new_tokens ids after idx ((B, t) ids, or 1-D for one sequence); returns idx with
    them appended (same number of dimensions). Each step runs the model on the last block_size ids
    (no cache: lesson 11 adds one) and samples from softmax(logits / temperature), restricted to
    the top_k most likely ids if given; temperature 0 takes the most likely id. max_new_tokens >= 0,
    temperature >= 0, top_k None or >= 1 (check_sampling). progress=True shows a progress bar over
    the new tokens."""
    from tqdm.auto import tqdm

    check_sampling("generate", max_new_tokens, temperature, top_k)
    idx = np.asarray(idx, dtype=np.int64)
    single = idx.ndim == 1
    idx = idx[None, :] if single else idx
    rng = rng if rng is not None else np.random.default_rng(0)
    was_training = model.training
    model.eval()
    with no_grad():
        for _ in tqdm(range(max_new_tokens), disable=not progress, desc="generating", unit="token"):
            logits, _ = model(idx[:, -model.config.block_size:])
            last = logits.numpy()[:, -1, :].astype(np.float64)
            if temperature == 0:
                nxt = last.argmax(axis=-1)
            else:
                last = last / temperature
                if top_k is not None and top_k < last.shape[-1]:
                    kth = np.sort(last, axis=-1)[:, -top_k][:, None]
                    last = np.where(last < kth, -np.inf, last)
                p = np.exp(last - last.max(axis=-1, keepdims=True))
                p /= p.sum(axis=-1, keepdims=True)
                nxt = np.array([rng.choice(p.shape[-1], p=row) for row in p])
            idx = np.concatenate([idx, nxt[:, None].astype(np.int64)], axis=1)
    model.train(was_training)
    return idx[0] if single else idx


from minitorch.checks import (Array, Attrs, Choice, Count, Fraction, Instance, Optional, Positive, Size,  # noqa: E402
                              Unchecked, validate_public)

_IDS = Array(ndim=1, dtypes="int")
_FLOATS = Array(dtypes="float")
_TENSOR = Instance(Tensor, must="a minitorch Tensor")
_WINDOWS = Array(ndim=2, dtypes="int", axes="(B, T)")
validate_public(globals(), {**globals().get("_ATTENTION_RULES", {}), **{
    "split_ids": {"ids": _IDS, "val_fraction": Fraction},
    "get_batch": {"ids": _IDS, "batch_size": Size, "block_size": Size},
    "eval_windows": {"ids": _IDS},
    "bigram_loss": {"train_ids": _IDS, "eval_ids": _IDS, "vocab_size": Size, "alpha": Positive},
    "layer_norm": {"x": _TENSOR, "weight": _TENSOR, "bias": _TENSOR, "eps": Positive},
    # the NumPy LayerNorm runs on lesson 11's inner loop: layer_norm_forward checks in its body
    "layer_norm_np": {"x": Unchecked(), "weight": Unchecked(), "bias": Unchecked(), "eps": Unchecked()},
    "gelu": {"x": _TENSOR},
    "layer_norm_forward": {"x": Unchecked(), "weight": Unchecked(), "bias": Unchecked(), "eps": Unchecked()},
    "check_sampling": {n: Unchecked() for n in ("what", "max_new_tokens", "temperature", "top_k")},  # its job
    "layer_norm_backward": {"g": _FLOATS, "xhat": _FLOATS, "rstd": _FLOATS, "weight": _FLOATS},
    "Embedding": {"num": Size, "dim": Size},
    "LayerNorm": {"dim": Size, "eps": Positive},
    "LayerNorm.forward": {"x": _TENSOR},
    "evaluate_loss": {"model": Attrs("config", "eval", "train"), "ids": _IDS, "n_windows": Optional(Size),
                      "batch_size": Size},
    "load_checkpoint": {"attention": Choice(*ATTENTION_IMPLS)},
    "load_tiny_gpt": {"attention": Choice(*ATTENTION_IMPLS)},
    "GPT": {"seed": Count},
    "GPT.forward": {"idx": _WINDOWS, "targets": Optional(_WINDOWS)},
    "lr_schedule": {"step": Count, "steps": Size, "lr": Positive, "warmup": Count, "min_ratio": Fraction},
    "train_gpt": {"train_ids": _IDS, "steps": Size, "batch_size": Size, "lr": Positive, "warmup": Count, "seed": Count,
                  "val_ids": Optional(_IDS), "eval_every": Size, "eval_windows": Optional(Size)},
    "generate": {"idx": Array(ndim=(1, 2), dtypes="int", axes="(B, t) or (t,)")},
}})
