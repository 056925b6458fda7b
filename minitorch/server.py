# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.server: the old name of lesson 15's server module, split since into the modules vLLM's
layout names: minitorch.scheduler (requests, prefix caching, the scheduling policy),
minitorch.engine (the engine core, the engine process), minitorch.api_server (the OpenAI HTTP API,
serve, main) and minitorch.metrics (Prometheus metrics, latency statistics, arrivals, goodput).
Kept so that a notebook saved before the split, `from minitorch.server import ...`, still runs
(and `python -m minitorch.server`): it holds the very objects of those modules. Import from them
in new code."""
if __name__ in ("minitorch.server", "__main__") and globals().get("__spec__") is not None:  # not a notebook
    import minitorch.api_server
    import minitorch.engine
    import minitorch.metrics
    import minitorch.scheduler

    for _module in (minitorch.scheduler, minitorch.engine, minitorch.metrics, minitorch.api_server):
        globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
    if __name__ == "__main__":  # python -m minitorch.server
        minitorch.api_server.main()
