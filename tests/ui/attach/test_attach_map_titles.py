"""The attach map's titles as a user sees them in a window of 1280x720: a long title (host, rank, medium, KV
group, its kind and window, the count) is never cut off at the view's edge nor drawn over the map above it,
and a resized view lays the maps out again for its shape (found under Xvfb on vLLM 0.33's own publisher:
"... sliding window 1,024 tokens   17 blocks (capacity: not in t" cut at the edge, titles on the frame above,
and maps a third of the width narrower than the view after the window was fitted to the screen)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtGui import QFontMetrics  # noqa: E402

from engine.attach.cluster import ClusterState  # noqa: E402
from engine.attach.events import BlockStored, decode_batch  # noqa: E402
from engine.attach.fake.publisher import encode  # noqa: E402
from ui.attach.block_map import AttachMap, title_fitted  # noqa: E402


def _cluster(ranks: int = 2) -> ClusterState:
    """Ranks of a hybrid vLLM: a full-attention GPU map of 2,000 blocks, a sliding-window group of 17 and a
    CPU tier of 500 each (the real publisher run's shape)."""
    c = ClusterState([f"127.0.0.1:47300/dp{r}" for r in range(ranks)])
    for src in range(ranks):
        h = src << 40
        evs = []
        for n, medium, group in ((2000, "GPU", 0), (17, "GPU", 1), (500, "CPU", 0)):
            kind = dict(kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=1024) if group else \
                dict(kv_cache_spec_kind="full_attention")
            for _ in range(n):
                h += 1
                evs.append(BlockStored([h], None, list(range(16)), 16, medium=medium, group_idx=group, **kind))
        c.apply(src, decode_batch(encode(evs, 1.0, src, "vllm", "tagged")), src)
    return c


def _shown(m: AttachMap, qtbot, w: int, h: int) -> None:
    m.resize(w, h)
    qtbot.waitUntil(lambda: m.view.width() > 0.8 * w, timeout=5000)
    qtbot.wait(50)


def _check_titles(m: AttachMap) -> None:
    right = m.view.width()
    frames = [f.sceneBoundingRect() for f in m._frames]
    for f in frames:  # every map in view
        assert f.top() >= -1 and f.bottom() <= m.view.height() + 1 and f.left() >= -1 and f.right() <= right + 1
    for i, label in enumerate(m._labels):
        d = label.textItem.document().documentMargin()  # the glyphs: inside the text item's margins
        r = label.mapRectToScene(label.boundingRect()).adjusted(d, d, -d, -d)
        text = label.textItem.toPlainText()
        assert r.right() <= right + 1, f"title {text!r} runs {r.right() - right:.0f} px past the view's edge"
        assert r.bottom() <= frames[i].top() + 2, f"title {text!r} over its own map"
        if i:
            assert r.top() >= frames[i - 1].bottom() - 1, \
                f"title {text!r} over the map above it ({r.top():.0f} < {frames[i - 1].bottom():.0f})"
        assert f"{m._snap.groups[i].resident:,} block" in text  # the count always stays


def test_titles_fit_the_view_and_never_cover_the_map_above(qtbot):
    c = _cluster()
    m = AttachMap()
    qtbot.addWidget(m)
    m.show()
    _shown(m, qtbot, 1400 - 560, 900 - 330)  # the map's share of the window's default size
    m.set_snapshot(c.snapshot("age"))
    qtbot.wait(50)
    _check_titles(m)
    cols = m._cells.layout.cols
    _shown(m, qtbot, 845, 380)  # the window fitted to a 1280x720 screen
    m.set_snapshot(c.snapshot("age"))
    qtbot.wait(50)
    assert m._cells.layout.cols != cols, "a view of another shape keeps the old layout"
    _check_titles(m)
    assert any("sliding window 1,024 tokens" in t for t in m.label_texts())
    assert m.label_texts()[0].endswith("2,000 blocks (capacity: not in the events)")  # the whole title kept


def test_a_title_gives_up_its_note_then_the_middle_of_its_label_never_its_count(qtbot):
    m = AttachMap()
    qtbot.addWidget(m)
    fm = QFontMetrics(m._font)
    label, count, note = "127.0.0.1:47300/dp1  rank 1  GPU  group 1  sliding window 1,024 tokens", "1 block", \
        " (capacity: not in the events)"
    assert title_fitted(fm, label, count, note, 10_000) == f"{label}   {count}{note}"
    assert title_fitted(fm, label, count, note, fm.horizontalAdvance(f"{label}   {count}")) == f"{label}   {count}"
    cut = title_fitted(fm, label, count, note, 200)
    assert cut.endswith("   1 block") and "…" in cut and fm.horizontalAdvance(cut) <= 200


@pytest.mark.parametrize("ranks", [3, 4])
def test_nine_or_twelve_maps_keep_their_titles_off_each_other_and_stay_in_view(qtbot, ranks):
    # 3 ranks x (GPU, sliding-window group, CPU) at 1280x720: the gaps grid_layout gave (sized against one map's
    # rows) put 8 of 9 titles on the maps above; the tallest window of a 1280x720 screen fits 12 titles
    c = _cluster(ranks)
    m = AttachMap()
    qtbot.addWidget(m)
    m.show()
    _shown(m, qtbot, 845, 380 if ranks == 3 else 520)
    m.set_snapshot(c.snapshot("age"))
    qtbot.wait(50)
    _check_titles(m)


def test_a_title_with_the_servers_capacity_says_it_once(qtbot):
    """With num_gpu_blocks from /metrics the title reads "2,000 blocks of 2,500 (num_gpu_blocks, /metrics)" —
    it read "2,000 blocks of 2,500 of 2,500 (...)" (the count and the note both carried the capacity)."""
    c = _cluster(1)
    m = AttachMap()
    qtbot.addWidget(m)
    m.capacity_fn = lambda key: 2500 if key[2] == "GPU" else None
    m.show()
    _shown(m, qtbot, 1600, 900)  # room for the whole title
    m.set_snapshot(c.snapshot("age"))
    qtbot.wait(50)
    shown = m._labels[0].textItem.toPlainText()
    assert shown.endswith("2,000 blocks of 2,500 (num_gpu_blocks, /metrics)"), shown
    assert shown.count("2,500") == 1 and m.label_texts()[0] == shown


def test_more_blocks_than_the_server_holds_says_why(qtbot):
    """'2,504 blocks of 2,500' was shown unexplained. The fake publisher (the demo) stored a request's blocks
    before it removed the ones they replaced, so a frame between the two counted more than the capacity; it now
    makes room first, as vLLM's BlockPool does (tests/attach/test_attach_state.py). A real server never holds
    more than num_gpu_blocks: a count past it is removals this session did not see, and the title says so."""
    c = _cluster(1)
    m = AttachMap()
    qtbot.addWidget(m)
    m.capacity_fn = lambda key: 1990 if key[2] == "GPU" and key[3] == 0 else None
    m.show()
    _shown(m, qtbot, 1600, 900)
    m.set_snapshot(c.snapshot("age"))
    qtbot.wait(50)
    shown = m._labels[0].textItem.toPlainText()
    assert shown.endswith("2,000 blocks of 1,990 (num_gpu_blocks, /metrics, 10 over: removals not seen)"), shown
