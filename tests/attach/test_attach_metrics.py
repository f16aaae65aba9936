"""/metrics: what is read from vLLM's and SGLang's expositions, absent metrics stay absent (the window says
"no data", never 0), rates from counters, histogram quantiles, and scraping over real HTTP."""

from __future__ import annotations

import http.server
import math
import threading
import time

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
    from engine.attach.fake.spawn import FakeProcess
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


# -- a server that is broken or hostile (real http.server servers on 127.0.0.1) ------------------------------

class _Hostile(http.server.BaseHTTPRequestHandler):
    """What each path does: /trickle a byte every 0.2 s, /big an endless body, /huge a 200 MB Content-Length,
    /redirect a 302 to another port, /odd values that cannot be true."""

    stop = threading.Event()
    other = ""  # where /redirect points
    hits = {"other": 0}

    def do_GET(self):
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", self.other)
            self.end_headers()
            return
        if self.path == "/target":
            _Hostile.hits["other"] += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        if self.path == "/huge":
            self.send_header("Content-Length", str(200 << 20))
        self.end_headers()
        try:
            if self.path == "/trickle":
                while not self.stop.wait(0.2):
                    self.wfile.write(b"#")
                    self.wfile.flush()
            elif self.path in ("/big", "/huge"):
                line = b"vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n" * 1000
                while not self.stop.is_set():
                    self.wfile.write(line)
            elif self.path == "/odd":
                self.wfile.write(ODD.encode())
            else:
                self.wfile.write(VLLM.encode())
        except OSError:  # the scraper hung up: what it should do
            pass

    def log_message(self, *a):
        pass


ODD = """\
vllm:kv_cache_usage_perc{engine="0"} -3.5
sglang:cache_hit_rate{tp_rank="0"} 5.0
vllm:num_preemptions_total{engine="0"} -1e308
vllm:prefix_cache_queries_total{engine="0"} 100.0
vllm:prefix_cache_hits_total{engine="0"} 50.0
vllm:cache_config_info{num_gpu_blocks="1000000000000000"} 1.0
vllm:kv_block_lifetime_seconds_bucket{le="1.0"} 5.0
vllm:kv_block_lifetime_seconds_bucket{le="+Inf"} 2.0
vllm:kv_block_lifetime_seconds_count 2.0
vllm:kv_block_lifetime_seconds_sum 1.0
"""


@pytest.fixture
def hostile():
    _Hostile.stop.clear()
    srvs = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile) for _ in range(2)]
    for s in srvs:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    _Hostile.other = f"http://127.0.0.1:{srvs[1].server_port}/target"
    _Hostile.hits["other"] = 0
    yield f"http://127.0.0.1:{srvs[0].server_port}"
    _Hostile.stop.set()
    for s in srvs:
        s.shutdown()
        s.server_close()


def test_a_server_trickling_a_byte_at_a_time_fails_the_scrape_at_its_deadline(hostile):
    x = Scraper(hostile + "/trickle", "slow", deadline_s=1.0)
    t0 = time.monotonic()
    s = x.scrape_once()
    assert s.error and "deadline" in s.error and x.failures == 1
    assert time.monotonic() - t0 < 10  # a bound, not a measurement: urllib's per-read timeout never ends


def test_a_body_past_the_cap_is_refused_without_reading_or_parsing_it_all(hostile):
    s = Scraper(hostile + "/big", "big", max_body=1 << 20).scrape_once()
    assert s.error and "limit" in s.error and not s.values
    s = Scraper(hostile + "/huge", "huge").scrape_once()  # a Content-Length of 200 MB: refused at once
    assert s.error and "209,715,200-byte body" in s.error


def test_a_redirect_is_not_followed(hostile):
    s = Scraper(hostile + "/redirect", "r").scrape_once()
    assert s.error and "302" in s.error and "not followed" in s.error
    assert _Hostile.hits["other"] == 0


def test_values_that_cannot_be_true_are_no_data_with_a_note(hostile):
    s = Scraper(hostile + "/odd", "odd").scrape_once()
    assert s.error is None
    assert s.values == {"prefix_queries": 100.0, "prefix_hits": 50.0}  # the only believable ones
    assert s.histograms == {}
    text = " ".join(s.notes)
    for word in ("usage -3.5", "sglang_hit_rate 5", "preemptions -1e+308", "num_gpu_blocks 1e+15", "lifetime"):
        assert word in text
    r = rates(None, s)
    assert math.isnan(r.usage) and math.isnan(r.hit_rate) and math.isnan(r.preemptions_per_s)
    assert parse_metrics(VLLM).notes == ()  # a sane exposition has none
    more = parse_metrics(VLLM.replace("300.0", "3000.0"))  # more hits than queries
    assert "prefix_hits" not in more.values and more.notes
