"""The block map against hand-made snapshots: one cell per block, codes per mode, selection, hover, relayout."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import Qt

from engine.telemetry.snapshot import SeqTable, Snapshot, TierSnapshot
from ui import palette as pal
from ui.block_map.grid import GridLayout, grid_layout
from ui.block_map.widget import MODES, BlockMap
from ui.block_map.bench import bench_block_map, fake_snapshot

BS = 4

# device: 10 slots. Sequence 7 owns 0, 1, 8; slot 4 is owned by 3 and shared with 7 (ref 2).
DEV = dict(state=[2, 2, 1, 0, 2, 2, 0, 1, 2, 0],
           owner=[7, 7, -1, -1, 3, 3, -1, 5, 7, -1],
           ref=[1, 1, 0, 0, 2, 1, 0, 0, 1, 0],
           fill=[4, 4, 4, 0, 4, 2, 0, 4, 3, 0],
           heat=[5.0, 1.0, 0.2, 0, 12.0, 0.5, 0, 0.05, 2.0, 0],
           age=[0.01, 0.5, 30.0, 0, 0.02, 2.0, 0, 100.0, 0.1, 0])


def _host(n: int = 23) -> dict:
    rng = np.random.default_rng(3)
    state = rng.choice([0, 1, 2], n, p=[0.3, 0.3, 0.4]).astype(np.uint8)
    owner = np.where(state == 2, rng.choice([3, 5, 40], n), -1).astype(np.int32)
    state[4:6] = 2
    owner[4:6] = 7  # sequence 7's two host blocks
    ref = np.where(state == 2, rng.integers(1, 7, n), 0)
    fill = np.where(state != 0, rng.integers(1, BS + 1, n), 0)
    heat = np.where(state != 0, rng.exponential(3, n), 0)
    age = np.where(state != 0, rng.exponential(5, n), 0)
    return dict(state=state, owner=owner, ref=ref, fill=fill, heat=heat, age=age)


def tier(name: str, d: dict) -> TierSnapshot:
    state = np.asarray(d["state"], np.uint8)
    return TierSnapshot(name=name, capacity=len(state), block_bytes=1 << 20, state=state,
                        owner=np.asarray(d["owner"], np.int32), ref=np.asarray(d["ref"], np.int32),
                        fill=np.asarray(d["fill"], np.int32), heat=np.asarray(d["heat"], np.float32),
                        age=np.asarray(d["age"], np.float32), hashed=np.asarray(d["fill"]) == BS)


def seqs(tables: dict[int, tuple[list[int], list[int]]], ids=(3, 5, 7, 40)) -> SeqTable:
    n = len(ids)
    z = np.zeros(n, np.int32)
    bt = tuple(np.asarray(tables.get(i, ([], []))[0], np.int8) for i in ids)
    bsl = tuple(np.asarray(tables.get(i, ([], []))[1], np.int64) for i in ids)
    return SeqTable(id=np.asarray(ids, np.int32), state=np.ones(n, np.int8), tokens=z, generated=z,
                    blocks_device=z, blocks_host=z, tokens_per_s=np.zeros(n, np.float32),
                    ttft=np.zeros(n, np.float32), prefix_reused=z, labels=tuple(f"req-{i}" for i in ids),
                    block_tier=bt, block_slot=bsl)


SEQ7 = ([0, 0, 0, 0, 1, 1], [0, 1, 4, 8, 4, 5])  # its block table: device 0, 1, 4 (shared), 8; host 4, 5


def snapshot(dev: dict = DEV, host: dict | None = None, tables=None) -> Snapshot:
    host = _host() if host is None else host
    tables = {7: SEQ7} if tables is None else tables
    return Snapshot(t=0.0, model={}, config={"block_size": BS}, tiers=(tier("device", dev), tier("host", host)),
                    seqs=seqs(tables), counters={}, windowed={}, memory={}, series={}, residency={})


def test_one_cell_per_block_and_state_counts(bm):
    snap = snapshot()
    bm.set_snapshot(snap)
    lay = bm.layout_info
    assert lay.capacities == (10, 23)
    assert bm.codes.dtype == np.uint8 and bm.codes.flags.c_contiguous
    assert bm.codes.shape == (lay.height, lay.cols)
    # every cell outside the two tiers is background, and there is a background gap between the tiers
    assert np.count_nonzero(bm.codes != pal.BACKGROUND_CODE) == 10 + 23
    assert lay.tops[1] >= lay.tops[0] + lay.rows[0] + 1
    assert np.all(bm.codes[lay.tops[0] + lay.rows[0]:lay.tops[1]] == pal.BACKGROUND_CODE)
    for i, t in enumerate(snap.tiers):
        codes = bm.tier_codes(i)
        assert codes.size == t.capacity
        for s in (0, 1, 2):
            assert np.count_nonzero(codes == s) == np.count_nonzero(t.state == s)
        np.testing.assert_array_equal(codes, t.state)
    assert "device" in bm.label_texts()[0] and "7 / 10 blocks" in bm.label_texts()[0]
    host_used = int(np.count_nonzero(snap.tiers[1].state))
    assert f"{host_used} / 23 blocks" in bm.label_texts()[1]


def test_modes_code_the_right_values(bm):
    snap = snapshot()
    bm.set_snapshot(snap)
    seen = {}
    for mode in MODES:
        bm.set_mode(mode)
        assert bm.mode() == mode and bm.mode_box.currentText() == mode
        seen[mode] = (bm.codes.copy(), np.array(bm.image.lut, copy=True))
        for i, t in enumerate(snap.tiers):
            c = bm.tier_codes(i).astype(int)
            free, cached, used = t.state == 0, t.state == 1, t.state == 2
            if mode != "state":
                assert np.all(c[free] == pal.FREE_CODE)
            if mode == "owner":
                np.testing.assert_array_equal(c[used], t.owner[used] & (pal.N_CATEGORICAL - 1))
                assert np.all(c[cached] == pal.CACHED_CODE)
            elif mode == "ref":
                np.testing.assert_array_equal(c[used], np.minimum(t.ref[used], 4))
                assert np.all(c[cached] == 0)
            elif mode == "fill":
                np.testing.assert_array_equal(c[~free], t.fill[~free])
            elif mode in ("heat", "age"):
                v = getattr(t, mode)[~free]
                order = np.argsort(v)
                assert np.all(np.diff(c[~free][order]) >= 0)  # monotone in the value
                assert c[~free].max() <= pal.VALUE_MAX
    for a in MODES:
        for b in MODES:
            if a < b:
                assert not (np.array_equal(seen[a][0], seen[b][0]) and np.array_equal(seen[a][1], seen[b][1])), (a, b)
    assert np.array_equal(seen["heat"][1][pal.FREE_CODE], pal.FREE)
    with pytest.raises(ValueError):
        bm.set_mode("nope")


def test_heat_range_and_colour_bar(bm):
    bm.set_snapshot(snapshot())
    bm.set_mode("heat")
    hottest = bm.tier_codes(0)[4]  # heat 12, the maximum
    assert hottest >= pal.VALUE_MAX - 40
    assert bm.tier_codes(0)[7] < bm.tier_codes(0)[1] < bm.tier_codes(0)[8] < hottest
    assert "heat" in bm.legend.text() and "20" in bm.legend.text()  # range 0.02 .. 20


def test_click_selects_the_owner_on_both_tiers(bm, qtbot):
    snap = snapshot()
    bm.set_snapshot(snap)
    with qtbot.waitSignal(bm.sequenceSelected, timeout=2000) as sig:
        qtbot.mouseClick(bm.view.viewport(), Qt.MouseButton.LeftButton, pos=bm.cell_pos(0, 8))
    assert sig.args == [7]
    assert bm.selected() == 7
    dev, host = bm.selected_cells()
    np.testing.assert_array_equal(dev, [0, 1, 4, 8])  # from the block table: the shared slot 4 included
    np.testing.assert_array_equal(host, [4, 5])
    assert "seq 7" in bm.legend.text()
    # the highlight is what the screen shows
    img = bm.view.viewport().grab().toImage()
    p = bm.cell_pos(1, 5)
    assert img.pixelColor(p).getRgb()[:3] == pal.SELECTED
    p = bm.cell_pos(0, 3)  # free, not selected
    assert img.pixelColor(p).getRgb()[:3] == pal.FREE
    # selection survives a new frame, other modes keep it too
    bm.set_snapshot(snapshot())
    bm.set_mode("heat")
    assert [list(x) for x in bm.selected_cells()] == [[0, 1, 4, 8], [4, 5]]
    # a free block selects nothing
    with qtbot.waitSignal(bm.sequenceSelected, timeout=2000) as sig:
        qtbot.mouseClick(bm.view.viewport(), Qt.MouseButton.LeftButton, pos=bm.cell_pos(0, 3))
    assert sig.args == [-1]
    assert [x.size for x in bm.selected_cells()] == [0, 0]


def test_set_selected_without_tables_falls_back_to_owner_and_does_not_emit(bm, qtbot):
    bm.set_snapshot(snapshot(tables={}))
    with qtbot.assertNotEmitted(bm.sequenceSelected):
        bm.set_selected(7)
    dev, host = bm.selected_cells()
    np.testing.assert_array_equal(dev, [0, 1, 8])  # owner == 7
    np.testing.assert_array_equal(host, [4, 5])
    bm.set_selected(-1)
    assert [x.size for x in bm.selected_cells()] == [0, 0]
    np.testing.assert_array_equal(bm.tier_codes(0), DEV["state"])


def test_hover_tooltip_shows_owner_and_fill(bm, qtbot):
    bm.set_snapshot(snapshot())
    qtbot.mouseMove(bm.view.viewport(), bm.cell_pos(0, 8))
    qtbot.waitUntil(lambda: bm.hover_text != "", timeout=2000)
    text = bm.hover_text
    assert "owner: 7 (req-7)" in text and "fill: 3/4" in text and "device" in text and "slot 8" in text
    assert "hashed: no" in text and "ref: 1" in text
    qtbot.wait(40)  # pyqtgraph drops mouse moves closer than 1/mouseRateLimit (10 ms) apart
    qtbot.mouseMove(bm.view.viewport(), bm.cell_pos(1, 4))
    qtbot.waitUntil(lambda: "host" in bm.hover_text, timeout=2000)
    assert "owner: 7" in bm.hover_text
    assert bm.tooltip_text(0, 3).count("state: free") == 1


def test_capacity_change_relays_the_grid(bm):
    bm.set_snapshot(snapshot())
    buf = bm.image.image.__array_interface__["data"][0]
    bm.set_snapshot(snapshot())
    assert bm.image.image.__array_interface__["data"][0] == buf  # same capacity: the buffer is reused
    old = bm.layout_info
    rng = np.random.default_rng(1)
    big = {k: np.resize(np.asarray(v), 300) for k, v in DEV.items()}
    big["state"] = rng.integers(0, 3, 300).astype(np.uint8)
    snap = snapshot(dev=big, host=_host(5))
    bm.set_snapshot(snap)
    lay = bm.layout_info
    assert lay.capacities == (300, 5) and lay != old
    assert lay.cols != old.cols
    assert bm.codes.shape == (lay.height, lay.cols)
    for i, t in enumerate(snap.tiers):
        assert bm.tier_codes(i).size == t.capacity
        for s in (0, 1, 2):
            assert np.count_nonzero(bm.tier_codes(i) == s) == np.count_nonzero(t.state == s)
    assert "/ 300 blocks" in bm.label_texts()[0] and "/ 5 blocks" in bm.label_texts()[1]
    assert bm.block_at(0.5, lay.tops[1] + 0.5) == (1, 0)
    assert bm.block_at(5.5, lay.tops[1] + 0.5) is None  # beyond the host tier's 5 slots
    assert bm.block_at(0.5, lay.tops[1] - 0.5) is None  # the gap


def test_grid_at_is_the_tier_and_slot_under_a_point():
    """GridLayout.at, which both block maps hit-test with: a tier's slots row-major, nothing in the gap, past a tier's
    last slot or outside the columns."""
    lay = GridLayout(cols=4, capacities=(6, 3), tops=(0, 3), rows=(2, 1), gap=1, height=4)
    assert lay.at(0.0, 0.0) == (0, 0) and lay.at(3.9, 0.5) == (0, 3) and lay.at(1.5, 1.2) == (0, 5)
    assert lay.at(2.5, 1.5) is None  # row 1 holds slots 4 and 5 only
    assert lay.at(0.5, 2.5) is None  # the gap
    assert lay.at(2.5, 3.5) == (1, 2) and lay.at(3.5, 3.5) is None
    assert lay.at(-0.1, 0.5) is None and lay.at(4.0, 0.5) is None and lay.at(0.5, -0.5) is None
    assert lay.at(0.5, 4.0) is None  # below the last tier


def test_grid_layout_follows_aspect():
    wide = grid_layout((60_000, 40_000), 2.0)
    assert 1.5 < wide.cols / (wide.height + wide.gap) < 2.6
    tall = grid_layout((60_000, 40_000), 0.5)
    assert tall.cols < wide.cols
    assert grid_layout((0, 7), 2.0).rows[0] == 0


def test_bench_runs_and_paints(qtbot):
    r = bench_block_map(20_000, frames=3)
    assert set(r["modes"]) == set(MODES)
    for m in r["modes"].values():
        assert m["paints_per_frame"] >= 1 and m["median_ms"] > 0


def test_fake_snapshot_is_consistent():
    s = fake_snapshot((500, 1500), n_seqs=10, seed=2)
    for t in s.tiers:
        assert np.all(t.heat[t.state == 0] == 0) and np.all(t.owner[t.state == 0] == -1)
    assert sum(len(x) for x in s.seqs.block_slot) == sum(int(np.count_nonzero(t.owner >= 0)) for t in s.tiers)


@pytest.mark.parametrize("height", [260, 330, 480])
def test_tier_labels_clear_the_tier_above_on_a_short_map(qtbot, height):
    """The demo's tiers (66 device and 273 host blocks) in the block map's place at 1280 x 720 and taller
    (issue 11: the host tier's label overlapped the device tier's frame)."""
    bm = BlockMap()
    qtbot.addWidget(bm)
    bm.resize(430, height)
    bm.show()
    qtbot.waitExposed(bm)
    bm.set_snapshot(fake_snapshot((66, 273)))
    qtbot.wait(20)
    from PySide6.QtCore import QPointF

    view, lay = bm.view, bm._layout

    def on_view(item):
        return view.mapFromScene(item.sceneBoundingRect()).boundingRect()

    def row_y(row: float) -> float:  # where an image row's top edge is, in the view's pixels
        return view.mapFromScene(bm.vb.mapViewToScene(QPointF(0, row))).y()

    device_bottom = row_y(lay.tops[0] + lay.rows[0])  # the device tier's frame, its last row's lower edge
    host_label = on_view(bm._labels[1])  # the text item's box, margins included
    assert host_label.top() > device_bottom + 1, (host_label, device_bottom)
    assert host_label.bottom() < row_y(lay.tops[1])  # and it sits above its own tier
    assert on_view(bm._labels[0]).top() >= 0  # the first tier's label is inside the view


def test_code_image_draws_rgb32_with_the_lut_colours(qtbot):
    """The map's image is converted from pyqtgraph's Indexed8 to RGB32 once per new image (Indexed8 drawn scaled
    cost 3.1 ms a paint, RGB32 0.37 ms): the pixels must still be the LUT's colours, cell by cell."""
    from PySide6.QtGui import QColor, QImage

    from ui.block_map.code_image import CodeImage

    lut = np.zeros((256, 3), np.uint8)
    lut[:, 0] = np.arange(256)
    lut[:, 1] = 255 - np.arange(256)
    lut[:, 2] = (np.arange(256) * 7) % 256
    codes = np.arange(24, dtype=np.uint8).reshape(4, 6) * 10
    img = CodeImage(axisOrder="row-major")
    img.setImage(codes, autoLevels=False, levels=(0, 256))
    img.setLookupTable(lut)
    img.render()
    q = img.qimage
    assert q.format() == QImage.Format.Format_RGB32
    assert (q.width(), q.height()) == (6, 4)
    for r in range(4):
        for c in range(6):
            want = lut[codes[r, c]]
            assert QColor(q.pixel(c, r)).getRgb()[:3] == tuple(int(v) for v in want)


@pytest.mark.parametrize("bs, want", [(1, "fill 0 1 token"), (2, "fill 0 2 tokens"), (16, "fill 0 8 16 tokens")])
def test_the_fill_legend_counts_tokens_in_the_singular_too(bm, bs, want):
    """At block size 1 the legend read "fill 0 0 1 tokens" (the middle tick is bs // 2)."""
    import dataclasses

    bm.set_snapshot(dataclasses.replace(snapshot(), config={"block_size": bs}))
    bm.set_mode("fill")
    assert bm.legend.text().startswith(want + " |"), bm.legend.text()
