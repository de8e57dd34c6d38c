"""Prometheus metrics of one server, on their own registry (so several apps can live in one process).

A running total is a counter (its samples end in `_total`), a level a gauge. Requests and tokens are
counted, and the three latencies every serving dashboard starts from observed as histograms (named as
vLLM names its own), by each front end: time to first token, the time between a stream's deliveries of
tokens (inter-token) and a request's end-to-end time; with several front-end
processes `sparkchat serve` sets PROMETHEUS_MULTIPROC_DIR and any front end's /metrics adds them all up
(prometheus_client's multiprocess mode). The engine's figures come from the engine process itself,
asked at each scrape (`engine`: its latest answer)."""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sparkchat_requests", "Chat completion, completion and response HTTP requests, by status code",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("sparkchat_prompt_tokens", "Prompt tokens accepted", registry=r)
        self.completion_tokens = Counter("sparkchat_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("sparkchat_time_to_first_token_seconds",
                              "From a request's submission to its first generated token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("sparkchat_inter_token_latency_seconds",
                             "From one delivery of a stream's tokens to its next (one token a step while it keeps "
                             "up; a reader that falls behind gets several in one)", registry=r,
                             buckets=(.001, .0025, .005, .01, .02, .04, .06, .08, .1, .25, .5, 1, 2.5))
        self.e2e = Histogram("sparkchat_e2e_request_latency_seconds",
                             "From a request's submission to its last token, for requests that were not cancelled",
                             registry=r, buckets=LATENCY_BUCKETS + (60, 120))
        self.loaded = False
        self.engine: dict | None = None  # the engine's counters at the last scrape (EngineLink.stats)
        r.register(self)

    def collect(self):
        """The engine's figures and whether it is loaded, as gauges and counters read at the scrape."""
        yield GaugeMetricFamily("sparkchat_model_loaded", "1 once the model is loaded", value=int(self.loaded))
        e = self.engine
        if e is None:
            return
        yield GaugeMetricFamily("sparkchat_queue_depth", "Requests waiting for a batch row", value=e["queue_depth"])
        yield GaugeMetricFamily("sparkchat_active_sequences", "Sequences in the running batch", value=e["num_active"])
        yield CounterMetricFamily("sparkchat_decode_steps", "Decode steps run since start (completion tokens "
                                  "per step is the mean batch)", value=e["steps"])
        yield CounterMetricFamily("sparkchat_engine_cpu_seconds", "CPU time of the engine's scheduler thread since "
                                  "start (near wall time: the host, not the device, sets the pace)",
                                  value=e["cpu_seconds"])
        yield CounterMetricFamily("sparkchat_engine_step_cpu_seconds", "CPU time (time.thread_time) the engine's "
                                  "scheduler thread spent inside engine steps, not in handing their tokens on or "
                                  "waiting for work", value=e["step_cpu_seconds"])
        yield CounterMetricFamily("sparkchat_engine_process_cpu_seconds", "CPU time of the whole process the engine "
                                  "runs in, every thread (the engine process's; a server built in one process: "
                                  "that process's)", value=e["process_cpu_seconds"])
        yield CounterMetricFamily("sparkchat_decode_steps_ahead", "Decode steps launched before the previous "
                                  "step's ids were read back (the device kept busy while the host handled them)",
                                  value=e["steps_ahead"])
        phases = CounterMetricFamily("sparkchat_engine_phase_seconds", "Wall time of the engine's scheduler thread "
                                     "by phase of its steps (model.engine.PHASES; decode includes wait)", labels=["phase"])
        for phase, seconds in e["phase_seconds"].items():
            phases.add_metric([phase], seconds)
        yield phases
        yield CounterMetricFamily("sparkchat_engine_admissions", "Prefills of waiting requests, each one forward "
                                  "or graph replay", value=e["admissions"])
        yield CounterMetricFamily("sparkchat_engine_admitted_requests", "Requests those prefills took in",
                                  value=e["admitted_rows"])

    def render(self) -> bytes:
        if not os.environ.get(MULTIPROC_ENV):
            return generate_latest(self.registry)
        every = CollectorRegistry()  # this process's counters come from the shared files too
        multiprocess.MultiProcessCollector(every)
        every.register(_Engine(self))
        return generate_latest(every)


class _Engine:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        return self.metrics.collect()
