# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.server_kit: the old name of lesson 15's given machinery, split since into
minitorch.serving_kit (uvicorn in a thread or a process, the lecture page, the front door, the load
generator's HTTP client) and minitorch.fused_decode (the fused decode step, FusedDecoder). Kept so
that a notebook saved before the split, `from minitorch.server_kit import ...`, still runs: it
holds the very objects of those modules. Import from them in new code."""
if __name__ == "minitorch.server_kit":  # the module, not this notebook
    import minitorch.fused_decode
    import minitorch.serving_kit

    for _module in (minitorch.serving_kit, minitorch.fused_decode):
        globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
