"""Prometheus metrics of one server, on their own registry (so several apps can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)
from prometheus_client.core import CounterMetricFamily


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sparkchat_requests", "Chat completion, completion and response HTTP requests, by status code",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("sparkchat_prompt_tokens", "Prompt tokens accepted", registry=r)
        self.completion_tokens = Counter("sparkchat_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("sparkchat_time_to_first_token_seconds",
                              "From a request's submission to its first generated token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.queue_depth = Gauge("sparkchat_queue_depth", "Requests waiting for a batch row", registry=r)
        self.active = Gauge("sparkchat_active_sequences", "Sequences in the running batch", registry=r)
        # totals read from the engine when scraped (a Counter cannot be read from a function)
        self.steps = Gauge("sparkchat_decode_steps", "Decode steps run since start (a total: completion "
                           "tokens per step is the mean batch)", registry=r)
        self.engine_cpu = Gauge("sparkchat_engine_cpu_seconds", "CPU time of the engine's scheduler thread "
                                "since start (near wall time: the host, not the device, sets the pace)", registry=r)
        self.loaded = Gauge("sparkchat_model_loaded", "1 once the model is loaded", registry=r)

    def watch_engine(self, engine) -> None:
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.active.set_function(lambda: engine.num_active)
        self.steps.set_function(lambda: engine.steps)
        self.engine_cpu.set_function(lambda: engine.cpu_seconds)
        self.registry.register(_EngineStepCPU(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStepCPU:
    """sparkchat_engine_step_cpu_seconds_total: CPU seconds (time.thread_time) the engine's thread spent
    inside its steps. A counter read from the engine when scraped (a prometheus Counter cannot be read
    from a function); bench/serve_gpu.py takes it from the server's process-tree CPU."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        yield CounterMetricFamily("sparkchat_engine_step_cpu_seconds", "CPU seconds the engine's thread spent "
                                  "inside its steps since start", value=self.engine.step_cpu_seconds)
