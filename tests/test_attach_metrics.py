"""/metrics: what is read from vLLM's and SGLang's expositions, absent metrics stay absent (the window says
"no data", never 0), rates from counters, histogram quantiles, and scraping over real HTTP."""

from __future__ import annotations

import http.server
import math
import threading

import pytest

from engine.attach.metrics import Histogram, MetricsSample, Scraper, parse_metrics, rates

VLLM = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 500.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="40960"} 1.0
# TYPE vllm:kv_block_lifetime_seconds histogram
vllm:kv_block_lifetime_seconds_bucket{engine="0",le="1.0"} 2.0
vllm:kv_block_lifetime_seconds_bucket{engine="0",le="10.0"} 8.0
vllm:kv_block_lifetime_seconds_bucket{engine="0",le="+Inf"} 10.0
vllm:kv_block_lifetime_seconds_count{engine="0"} 10.0
vllm:kv_block_lifetime_seconds_sum{engine="0"} 42.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0"} 5.0
"""

SGLANG = """\
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m",tp_rank="0"} 0.125
"""


def test_vllm_values_summed_or_averaged_over_engines():
    s = parse_metrics(VLLM, t=10.0)
    v = s.values
    assert v["usage"] == pytest.approx(0.5)  # mean of the engines' fractions
    assert v["prefix_queries"] == 2000 and v["prefix_hits"] == 800 and v["preemptions"] == 4
    assert v["num_gpu_blocks"] == 40960
    h = s.histograms["lifetime"]
    assert h.count == 10 and h.mean == pytest.approx(4.2)
    assert h.quantile(0.5) == pytest.approx(1.0 + 9.0 * (5 - 2) / 6)  # Prometheus' histogram_quantile
    assert "idle_before_evict" not in s.histograms and "reuse_gap" not in s.histograms
    assert "sglang_hit_rate" not in v


def test_sglang_values_and_absent_vllm_metrics_stay_absent():
    s = parse_metrics(SGLANG)
    assert s.values == {"usage": 0.5, "sglang_hit_rate": 0.125}
    r = rates(None, s)
    assert r.usage == 0.5 and r.hit_rate == 0.125
    assert math.isnan(r.preemptions_per_s) and math.isnan(r.hit_rate_total)  # "no data", not 0


def test_rates_from_two_scrapes_and_a_counter_reset_draws_nothing():
    a = parse_metrics(VLLM, t=10.0)
    b = parse_metrics(VLLM.replace("1000.0", "1100.0").replace("300.0", "350.0").replace(
        "num_preemptions_total{engine=\"0\",model_name=\"m\"} 4.0", "num_preemptions_total{engine=\"0\",model_name=\"m\"} 6.0"),
        t=12.0)
    r = rates(a, b)
    assert r.hit_rate == pytest.approx(50 / 200) and r.preemptions_per_s == pytest.approx(1.0)
    assert r.hit_rate_total == pytest.approx(850 / 2200)
    reset = parse_metrics(VLLM.replace("1000.0", "10.0"), t=13.0)
    assert math.isnan(rates(b, reset).hit_rate)


def test_histogram_quantile_edges():
    assert math.isnan(Histogram(0, 0, ()).quantile(0.5))
    h = Histogram(4, 100, ((1.0, 0.0), (float("inf"), 4.0)))
    assert h.quantile(0.9) == 1.0  # everything above the last finite bound: that bound


def test_not_prometheus_text_raises_value_error():
    with pytest.raises(ValueError):
        parse_metrics("this is { not metrics")


class _Handler(http.server.BaseHTTPRequestHandler):
    body = VLLM.encode()

    def do_GET(self):
        if self.path != "/metrics":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


@pytest.fixture
def metrics_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)  # the test plays the server
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


def test_scrape_over_http_and_failures_are_reported_not_raised(metrics_server):
    ok = Scraper(metrics_server + "/metrics", "srv")
    s = ok.scrape_once()
    assert s.error is None and s.values["prefix_hits"] == 800
    ok.scrape_once()
    assert len(ok.history()) == 2 and ok.latest().values["usage"] == 0.5
    missing = Scraper(metrics_server + "/nope", "srv")
    bad = missing.scrape_once()
    assert bad.error and "404" in bad.error and missing.failures == 1 and missing.history() == []
    dead = Scraper("http://127.0.0.1:9/metrics", "dead")
    assert dead.scrape_once().error and dead.latest() is None


def test_the_fake_publishers_exposition_parses_with_every_metric():
    from engine.attach.fake_spawn import FakeProcess
    from engine.attach.metrics import fetch

    fake = FakeProcess("--rate", "2000", "--duration", "1.5", "--metrics-port", "0", "--kv-cache-metrics",
                       "--linger", "5", "--capacity", "300")
    try:
        fake.summary()
        s = parse_metrics(fetch(fake.metrics))
        assert {"usage", "prefix_queries", "prefix_hits", "preemptions", "num_gpu_blocks"} <= set(s.values)
        assert s.values["prefix_queries"] >= s.values["prefix_hits"] > 0
        assert s.histograms["lifetime"].count > 0 and s.histograms["idle_before_evict"].count > 0
    finally:
        fake.stop()


def test_metrics_sample_without_data_is_empty():
    s = MetricsSample(1.0, error="URLError: refused")
    assert s.values == {} and s.histograms == {}
