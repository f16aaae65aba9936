"""What a user reads of today's fields: the KV-cache group's kind and window in each map's title, and in a
block's tooltip its LoRA, session, cache salt, locality / ownership, extra hash keys, lookahead tokens, and
whether it is a hash-only placeholder (from the real servers' captured bytes, tests/data/attach/), escaped."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from engine.attach import codes  # noqa: E402
from engine.attach.cluster import ClusterState  # noqa: E402
from engine.attach.events import BlockStored, decode_batch  # noqa: E402
from engine.attach.fake.publisher import encode  # noqa: E402
from tests.attach.test_attach_real_bytes import SERVERS, _ranks  # noqa: E402
from ui.attach.block_map import meta_lines  # noqa: E402


def _real_cluster() -> ClusterState:
    c = ClusterState(list(SERVERS))
    for src, server in enumerate(SERVERS):
        for rank, live, _, _ in _ranks(server):
            for _, _, payload in live[:-1]:
                c.apply(src, decode_batch(payload), rank)
    return c


def _info(c, key, h):
    g = c.groups[key]
    return g.info(g.index[h], time.time())


def test_the_tooltip_says_lora_session_extra_keys_and_lookahead_of_a_real_vllm_block():
    c = _real_cluster()
    text = "<br>".join(meta_lines(_info(c, (0, 0, "GPU", 0), bytes.fromhex("00" * 31 + "a3"))))
    assert "LoRA sql-adapter (id 3)" in text and "session chat-42" in text
    assert "extra hash keys ['sql-adapter', 'salt-1']" in text and "lookahead tokens [148, 149]" in text


def test_the_tooltip_says_sglangs_cache_salt_and_the_title_names_the_group():
    c = _real_cluster()
    text = "<br>".join(meta_lines(_info(c, (1, 0, "GPU", 0), -(1 << 63) + 9)))
    assert "LoRA math-lora" in text and "session s-1" in text and "cache salt tenant-7" in text
    bigram = "<br>".join(meta_lines(_info(c, (1, 0, "GPU", 0), -17)))  # SGLang's EAGLE page, as it sent it
    assert "EAGLE bigram page" in bigram and "EAGLE" not in text
    assert c.group_label((0, 0, "GPU", 1)) == "vllm  rank 0  GPU  group 1  sliding window 4,096 tokens"
    assert c.group_label((1, 0, "CPU", 0)) == "sglang  rank 0  CPU"  # SGLang names no group kind


def test_a_placeholder_and_remote_locality_are_said_and_what_the_server_sent_is_escaped():
    c = ClusterState(["v"])
    evs = [BlockStored([5], None, [], 0, medium="CPU", locality="REMOTE", ownership="<b>tier</b>"),
           BlockStored([6], None, list(range(16)), 16, lora_name="<script>x</script>", session_id="a&b")]
    c.apply(0, decode_batch(encode(evs, 1.0, 0, "vllm", "tagged")))
    text = "<br>".join(meta_lines(_info(c, (0, 0, "CPU", 0), 5)))
    assert "placeholder" in text and "locality REMOTE, ownership &lt;b&gt;tier&lt;/b&gt;" in text
    text = "<br>".join(meta_lines(_info(c, (0, 0, "GPU", 0), 6)))
    assert "&lt;script&gt;" in text and "<script>" not in text and "session a&amp;b" in text


def test_the_window_titles_a_real_shaped_vllm_map_with_its_group_kind(qtbot):
    from engine.attach.fake.spawn import FakeProcess
    from engine.attach.session import AttachSession
    from engine.attach.source import parse_source
    from ui.attach.window import AttachWindow

    fake = FakeProcess("--flavor", "vllm", "--rate", "1000", "--batch", "20", "--duration", "3", "--capacity",
                       "300", "--linger", "3")
    session = AttachSession(parse_source("vllm", f"{fake.pub},name=v"), []).start()
    win = AttachWindow(session, None, owns_session=True, refresh_ms=50)
    qtbot.addWidget(win)
    win.show()
    try:
        qtbot.waitUntil(lambda: bool(win.map.label_texts() and win.map._snap is not None and win.map._snap.groups
                                     and win.map._snap.groups[0].resident > 0), timeout=20000)
        assert win.map.label_texts()[0].startswith("v  rank 0  GPU  full attention")
        g = win.map._snap.groups[0]
        cell = int(np.flatnonzero(g.codes != codes.EMPTY_CODE)[0])
        tip = win.map.tooltip_for(0, cell)
        assert tip.startswith("<b>v  rank 0  GPU  full attention</b>") and "hash " in tip
    finally:
        win.close()
        fake.stop()
