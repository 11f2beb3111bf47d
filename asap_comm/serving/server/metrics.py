"""The service's Prometheus metrics (``GET /metrics``): request outcomes, TTFT and queue time, admitted and
waiting tokens, and the workers' live statistics (``protocol.WorkerStats``) and heartbeat ages. The metric
names and help texts are the README's table ("The online service")."""
from __future__ import annotations

import math

from ..protocol import BATCH_BUCKETS

__all__ = ["TTFT_BUCKETS", "ServiceMetrics", "WorkerCollector", "LaneCollector", "FailoverCollector"]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


class ServiceMetrics:
    """The registry of one service: what :class:`~.engine.Engine` counts, gauges read from it on every scrape,
    and a :class:`WorkerCollector`."""

    def __init__(self, svc) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("asap_time_to_first_token_seconds", "Server-side TTFT: admission to the result "
                              "reaching the front end", registry=r, buckets=TTFT_BUCKETS)
        self.queue = Histogram("asap_request_queue_time_seconds", "Admission until the request's last chunk "
                               "entered its rank's inbox", registry=r, buckets=TTFT_BUCKETS)
        self.prompt = Counter("asap_prompt_tokens", "Prompt tokens of completed requests", registry=r)
        self.requests = Counter("asap_requests", "Requests by outcome (ok, invalid, unauthorized, overloaded, "
                                "timeout, cancelled, unavailable)", ["outcome"], registry=r)
        self.running = Gauge("asap_num_requests_running", "Requests admitted and not finished", registry=r)
        self.running.set_function(lambda: len(svc.fe.inflight))
        self.tokens = Gauge("asap_admitted_prompt_tokens", "Prompt tokens admitted and not finished (bounded by "
                            "--max-queued-tokens)", registry=r)
        self.tokens.set_function(lambda: svc.fe.queued_tokens)
        self.waiting = Gauge("asap_num_requests_waiting", "Calls in the waiting room (first come, first served)",
                             registry=r)
        self.waiting.set_function(lambda: len(svc.room))
        self.waiting_tokens = Gauge("asap_waiting_prompt_tokens", "Prompt tokens of the calls in the waiting "
                                    "room (bounded by --max-waiting-tokens)", registry=r)
        self.waiting_tokens.set_function(lambda: svc.room.tokens)
        self.held = Gauge("asap_num_calls_held", "Calls held unread: their client got 429 from the full waiting "
                          "room and still holds its share of it (--refused-hold-s)", registry=r)
        self.held.set_function(lambda: len(svc.held))
        self.braked = Gauge("asap_num_calls_braked", "Calls waiting before they are handled: their client had many "
                            "calls refused as its own error just now (--bad-call-delay-s)", registry=r)
        self.braked.set_function(lambda: len(svc.brake))
        self.closed = Counter("asap_connections_closed", "Connections the service closed by reason (header_timeout, "
                              "idle, evicted: the oldest idle one at --max-connections, refused: 503 at the limit)",
                              ["reason"], registry=r)
        self.open = Gauge("asap_open_connections", "Connections open now", registry=r)
        self.limit = Gauge("asap_connections_limit", "--max-connections", registry=r)
        r.register(WorkerCollector(svc))
        r.register(LaneCollector(svc))
        r.register(FailoverCollector(svc))

    def completed(self, c) -> None:
        """A request's result (a ``frontend.Completion``) reached the front end."""
        self.ttft.observe(c.done_s)
        self.queue.observe(c.queue_s)
        self.prompt.inc(c.tokens)

    def watch_connections(self, guard) -> None:
        """Report ``guard``'s (a ``frontdoor.ConnectionGuard``) open connections and limit."""
        self.open.set_function(lambda: len(guard))
        self.limit.set(guard.max_connections)

    def connection_closed(self, reason: str) -> None:
        """One more connection closed by the front door, in ``asap_connections_closed_total{reason}``."""
        self.closed.labels(reason).inc()

    def count(self, outcome: str) -> None:
        """One more request in ``asap_requests_total{outcome}``."""
        self.requests.labels(outcome).inc()

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric (content type ``CONTENT_TYPE``)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class WorkerCollector:
    """Prometheus collector of the workers' live statistics (``protocol.WorkerStats``) and heartbeat ages."""

    def __init__(self, svc) -> None:
        self.svc = svc

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        rows = self.svc.stats.rows()
        self.svc.beats.observe()
        ages = self.svc.beats.ages()
        busy = GaugeMetricFamily("asap_rank_busy_fraction", "Fraction of its lifetime a worker spent computing",
                                 labels=["pe", "role"])
        beat = GaugeMetricFamily("asap_worker_heartbeat_age_seconds", "Seconds since the front end saw the worker's "
                                 "statistics row change (it publishes every 0.1 s while it runs)",
                                 labels=["pe", "role"])
        hist = HistogramMetricFamily("asap_expert_batch_size_rows", "Rows per expert batch (async: per expert "
                                     "rank's gathered batch; sync: per worker's all-to-all share)", labels=["pe"])
        for pe in range(self.svc.comm.world_size - 1):
            r = rows[pe]
            role = self.svc.role_of(pe)
            busy.add_metric([str(pe), role], r["busy_fraction"])
            beat.add_metric([str(pe), role], ages[pe])
            if r["batches"]:
                cum, buckets = 0, []
                for ub, n in zip(list(BATCH_BUCKETS) + [math.inf], r["buckets"]):
                    cum += n
                    buckets.append(("+Inf" if ub == math.inf else str(float(ub)), cum))
                hist.add_metric([str(pe)], buckets, sum_value=r["rows"])
        yield busy
        yield beat
        yield hist


class LaneCollector:
    """Prometheus collector of the long-prompt lane's admission (``serving.lane.FrontLane``): lanes opened, prompts
    that found no room and waited, those that gave up after ``--lane-wait-s``, and the prompts waiting now.
    Nothing where the lane is off (the baseline, one attention rank, ``--no-long-prompt-lane``)."""

    def __init__(self, svc) -> None:
        self.svc = svc

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        lane = self.svc.fe.lane
        if not lane.active:
            return
        c = lane.counts
        yield CounterMetricFamily("asap_lane_opened", "Long prompts that took the long-prompt lane", value=c.opened)
        yield CounterMetricFamily("asap_lane_waited", "Long prompts that found no room in the lane's KV pool on "
                                  "arrival and waited for it", value=c.waited)
        yield CounterMetricFamily("asap_lane_gave_up", "Long prompts that waited --lane-wait-s for the lane and ran "
                                  "on one attention rank", value=c.gave_up)
        yield GaugeMetricFamily("asap_lane_waiting", "Long prompts waiting for room in the lane now",
                                value=len(lane.waiting))


class FailoverCollector:
    """Prometheus collector of failover (``serving.failover``; docs/failover.md): expert ranks a spare took over
    (``asap_expert_failovers_total``) and the spares left, nothing without spare expert ranks; attention PEs lost
    and survived (``asap_attention_failovers_total``) and requests re-admitted
    (``asap_attention_readmissions_total``), nothing without ``--attention-failover``."""

    def __init__(self, svc) -> None:
        self.svc = svc

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        at = self.svc.fe.attention
        if at is not None:  # attention failover (--attention-failover)
            yield CounterMetricFamily("asap_attention_failovers", "Attention PEs that died while another lived: "
                                      "their requests were re-admitted (--attention-failover)", value=at.count)
            yield CounterMetricFamily("asap_attention_readmissions", "Requests re-admitted on the live attention "
                                      "ranks after their attention PE died", value=at.readmissions)
        fo = self.svc.fe.failover
        if fo is None:
            return
        yield CounterMetricFamily("asap_expert_failovers", "Expert ranks whose PE died and a spare expert PE took "
                                  "over (--spare-expert-ranks)", value=fo.count)
        yield GaugeMetricFamily("asap_spare_expert_ranks_left", "Spare expert PEs alive and not yet used",
                                value=len(fo.spares))
