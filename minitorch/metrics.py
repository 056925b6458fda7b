# Generated from solutions/15_serving.py by `make build`. Do not edit.
"""minitorch.metrics: what lesson 15's server reports and what its load generator measures
(vLLM's metrics and benchmark_serving's statistics): Prometheus histograms and the /metrics
text, latency percentiles (TTFT, TPOT, inter-token), Poisson arrivals and goodput."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if globals().get("__spec__") is not None:  # a module (not a notebook, whose own cells define these names)
    from minitorch.scheduler import _describe, _is_int, _is_number
if TYPE_CHECKING:  # annotations only: the engine and the API server import this module
    from minitorch.api_server import RequestLog
    from minitorch.engine import Engine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
HISTOGRAMS = (  # RequestLog's name, the metric's (vLLM's names), help, buckets
    ("ttft", "time_to_first_token_seconds", "Time to first token, from arrival.", LATENCY_BUCKETS),
    ("tpot", "time_per_output_token_seconds", "Time per output token after the first.", LATENCY_BUCKETS),
    ("e2e", "e2e_request_latency_seconds", "From arrival to the last token.", REQUEST_BUCKETS),
    ("queue", "request_queue_time_seconds", "From arrival to the first step that ran it.", REQUEST_BUCKETS))


class Histogram:
    """A Prometheus histogram: `buckets`, increasing finite upper bounds; counts of observations
    per bucket, their sum and count."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]):
        for what, text in (("name", name), ("help", help)):
            if not isinstance(text, str) or (what == "name" and not text.replace("_", "a").isalnum()):
                raise ValueError(f"Histogram: {what} must be a str (name: letters, digits and _), got {_describe(text)}")
        if not isinstance(buckets, (list, tuple, np.ndarray)) or not all(_is_number(b) for b in buckets):
            raise ValueError(f"Histogram {name}: buckets must be a sequence of numbers, got {_describe(buckets)}")
        bounds = [float(b) for b in buckets]
        if not bounds or any(b >= c for b, c in zip(bounds, bounds[1:])) or not all(map(math.isfinite, bounds)):
            raise ValueError(f"Histogram {name}: buckets must be increasing finite numbers, got {list(buckets)}")
        self.name, self.help, self.bounds = name, help, bounds
        self.counts = [0] * (len(bounds) + 1)     # the last: above every bound
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        """Count one observation: in the first bucket whose bound is >= value (or above all)."""
        if not _is_number(value) or math.isnan(value):
            raise ValueError(f"Histogram {self.name}: value must be a number, not NaN, got {_describe(value)}")
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += float(value)
        self.count += 1

    def render(self) -> str:
        """The text format: "# HELP name help", "# TYPE name histogram", one line
        name_bucket{le="<bound>"} <observations <= bound> per bound (cumulative), then le="+Inf"
        (all of them), then name_sum and name_count; lines end with a newline."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            lines.append(f'{self.name}_bucket{{le="{bound!r}"}} {total}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return "\n".join(lines) + "\n"


def _check_records(where: str, records: Any) -> None:
    """records must be a list or tuple of dicts with "start" and "token_times" (run_load's)."""
    if not isinstance(records, (list, tuple)) or not all(
            isinstance(r, dict) and "start" in r and "token_times" in r for r in records):
        raise ValueError(f"{where}: records must be a list of dicts with 'start' and 'token_times' (run_load's), "
                         f"got {_describe(records)}")


def latency_stats(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{"ttft" | "tpot" | "itl": {"mean", "p50", "p90", "p99"}} in seconds from records, each a dict
    with "start" (send time) and "token_times" (arrival of each token, increasing); records with
    a "status" other than 200, or no tokens, are left out."""
    _check_records("latency_stats", records)
    ttft, tpot, itl = [], [], []
    for r in records:
        times = list(r["token_times"])
        if r.get("status", 200) != 200 or not times:
            continue
        ttft.append(times[0] - r["start"])
        if len(times) >= 2:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(np.diff(times).tolist())

    def summary(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
        p = np.percentile(values, [50, 90, 99])
        return {"mean": float(np.mean(values)), "p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}

    return {"ttft": summary(ttft), "tpot": summary(tpot), "itl": summary(itl)}


def render_metrics(engine: Engine, log: RequestLog) -> str:
    """The engine's state in Prometheus text format: gauges (requests running and waiting, KV
    blocks used, cached and total, tokens/s, prefix hit rate), counters (finished requests by
    finish reason; aborted, failed and rejected ones apart), and histograms of the latencies of the
    requests the server finished (HISTOGRAMS, measured inside the server from acceptance). The
    histograms are cumulative over the server's life, as Prometheus requires (a counter that falls
    reads as a restart): each call adds what `log` filed since the last call to the same
    Histograms, kept in log.histograms."""
    s = engine.stats()
    out = []
    for name, kind, value, help in (
            ("num_requests_running", "gauge", s["running"], "Requests in the KV cache."),
            ("num_requests_waiting", "gauge", s["waiting"], "Requests in the queue."),
            ("kv_blocks_used", "gauge", s["kv_blocks_used"], "KV cache blocks held by requests."),
            ("kv_blocks_cached", "gauge", s["kv_blocks_cached"], "KV cache blocks in the prefix cache."),
            ("kv_blocks_total", "gauge", s["kv_blocks_total"], "KV cache blocks in the pool."),
            ("generation_tokens_per_second", "gauge", s["tokens_per_s"], "Output tokens per second, last 5 s."),
            ("prefix_cache_hit_rate", "gauge", s["prefix_hit_rate"], "Prompt tokens found in the prefix cache."),
            ("generation_tokens_total", "counter", s["generated_tokens"], "Output tokens generated."),
            ("prompt_tokens_total", "counter", s["prompt_tokens"], "Prompt tokens admitted."),
            ("request_aborted_total", "counter", s["aborted"], "Requests aborted (client gone), not counted as success."),
            ("request_failed_total", "counter", s.get("failed", 0), "Requests ended by an error."),
            ("request_rejected_total", "counter", s["rejected"], "Requests refused with 429."),
            ("num_preemptions_total", "counter", s["preemptions"], "Preemptions.")):
        out.append(f"# HELP minitorch_{name} {help}\n# TYPE minitorch_{name} {kind}\nminitorch_{name} {float(value)!r}\n")
    stopped = s.get("stopped", 0)
    out.append("# HELP minitorch_request_success_total Requests finished, by finish reason.\n"
               "# TYPE minitorch_request_success_total counter\n"
               f'minitorch_request_success_total{{finished_reason="length"}} {float(s["finished"] - stopped)!r}\n'
               f'minitorch_request_success_total{{finished_reason="stop"}} {float(stopped)!r}\n')
    if log.histograms is None:
        log.histograms = {key: Histogram(f"minitorch_{name}", help, buckets) for key, name, help, buckets in HISTOGRAMS}
    for key, values in log.drain().items():
        for value in values:
            log.histograms[key].observe(value)
    return "".join(out) + "".join(h.render() for h in log.histograms.values())


def poisson_arrivals(rate: float, n: int, rng: Any = 0) -> np.ndarray:
    """Send times (n,) float64 in seconds from the start of a Poisson process of `rate`
    requests per second: the cumulative sum of n independent exponential gaps of mean 1 / rate,
    drawn from np.random.default_rng(rng); all zeros when rate is inf. rate > 0, n >= 0."""
    if not _is_number(rate) or not rate > 0:
        raise ValueError(f"poisson_arrivals: rate must be a number > 0 (requests per second; inf: all at once), "
                         f"got {_describe(rate)}")
    if not _is_number(n) or not math.isfinite(n) or int(n) != n or n < 0:
        raise ValueError(f"poisson_arrivals: n must be an integer >= 0, got {_describe(n)}")
    if not (_is_int(rng) and rng >= 0 or isinstance(rng, (np.random.Generator, np.random.SeedSequence))):
        raise ValueError(f"poisson_arrivals: rng must be a seed (an integer >= 0) or a np.random.Generator, "
                         f"got {_describe(rng)}")
    if math.isinf(rate):
        return np.zeros(int(n))
    return np.cumsum(np.random.default_rng(rng).exponential(1.0 / rate, int(n)))


def goodput(records: Sequence[dict[str, Any]], duration: float, ttft_slo: float, tpot_slo: float) -> float:
    """Requests per second over `duration` seconds that succeeded (status 200, or no status, and
    at least one token) with TTFT <= ttft_slo and, if they have two or more tokens, TPOT =
    (last - first) / (n - 1) <= tpot_slo (the first token is not counted: it is the TTFT's).
    records as for latency_stats. duration: finite, > 0; an SLO: >= 0 (inf: no bound)."""
    _check_records("goodput", records)
    if not _is_number(duration) or not 0 < duration < math.inf:
        raise ValueError(f"goodput: duration must be a finite number of seconds > 0, got {_describe(duration)}")
    for name, slo in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
        if not _is_number(slo) or not slo >= 0:
            raise ValueError(f"goodput: {name} must be a number of seconds >= 0 (inf: no bound), got {_describe(slo)}")
    good = 0
    for r in records:
        times = list(r["token_times"])
        if r.get("status", 200) != 200 or not times or times[0] - r["start"] > ttft_slo:
            continue
        if len(times) >= 2 and (times[-1] - times[0]) / (len(times) - 1) > tpot_slo:
            continue
        good += 1
    return good / duration


from minitorch.checks import Attrs, Number, Unchecked, validate_public  # noqa: E402

validate_public(globals(), {
    "Histogram.observe": {"value": Number(finite=False)},      # inf is a (slow) observation: the +Inf bucket
    "render_metrics": {"engine": Attrs("stats"), "log": Attrs("drain", "histograms")},
    "poisson_arrivals": {"rate": Number(0, lo_open=True, finite=False), "rng": Unchecked()},   # inf: all at once
    "goodput": {"ttft_slo": Number(0, finite=False), "tpot_slo": Number(0, finite=False)},   # inf: no bound
})
