# Generated from solutions/11_kv_cache.py by `make build`. Do not edit.
"""minitorch.serve: the old name of lesson 11's module, now minitorch.kv_cache (the KV cache, paged
attention, continuous batching, speculative decoding). Kept so that a notebook saved before the
rename, `from minitorch.serve import ...`, still runs: it holds the very objects of
minitorch.kv_cache. Import from minitorch.kv_cache in new code."""
if __name__ == "minitorch.serve":  # the module, not this notebook (whose names are its own)
    import minitorch.kv_cache as _kv_cache

    globals().update({k: v for k, v in vars(_kv_cache).items() if not k.startswith("__")})
