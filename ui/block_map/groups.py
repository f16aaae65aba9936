"""One block map section per KV-cache group (engine/kv/groups.py): a model with full and sliding-window layers keeps a
pool per group, and each is drawn as its own map, titled with the group ("full attention · 3 layers", "sliding window
512 · 15 layers"), its occupancy per tier and its device hit rate. A snapshot without groups (one pool for every
layer, or a file saved without group data) draws the one map, untitled.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QSizePolicy, QSplitter, QVBoxLayout, QWidget

from engine.telemetry.snapshot import Snapshot
from ui.block_map.widget import BlockMap

HIT_TIP = ("dev / host: this group's blocks in use or cached / the tier's capacity, in its own pool; hit: keys this "
           "group's attention read from blocks already on the device tier / all keys it read (since the engine "
           "started; a window group reads only its window's keys)")


def group_title(group: dict) -> str:
    """The section's title: the group, each tier's blocks held / capacity, its device hit rate ("no data" before
    any key was read)."""
    tiers = group["tiers"]
    held = ", ".join(f"{'dev' if t.name == 'device' else t.name} {t.used:,}/{t.capacity:,}" for t in tiers)
    read, missed = group["read_tokens"], group["read_tokens_missed"]
    hit = f"{100.0 * (1 - missed / read):.1f} %" if read else "no data"
    return f"{group['title']}  ·  {held}  ·  hit {hit}"


class GroupMaps(QWidget):
    """The primary map (the first group's pool, or the one pool) and one more per further KV-cache group."""

    sequenceSelected = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.splitter = QSplitter(Qt.Vertical)
        self.splitter.setChildrenCollapsible(False)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.splitter)
        self.primary = BlockMap()
        self.sections: list[tuple[QLabel, BlockMap]] = []
        self._add_section(self.primary)
        self.sections[0][0].hide()  # untitled until a snapshot has groups
        self._selected = -1

    def _add_section(self, bmap: BlockMap) -> None:
        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(1)
        title = QLabel()
        title.setToolTip(HIT_TIP)
        # The title never widens the window (a long one pushed the Controls dock past a 1280-pixel screen).
        title.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Fixed)
        lay.addWidget(title)
        lay.addWidget(bmap, 1)
        self.splitter.addWidget(box)
        self.sections.append((title, bmap))
        if bmap is not self.primary:
            bmap.sequenceSelected.connect(self._selected_in_section)

    def _selected_in_section(self, seq_id: int) -> None:
        self.set_selected(seq_id)
        self.primary.set_selected(seq_id)
        self.sequenceSelected.emit(seq_id)

    def maps(self) -> list[BlockMap]:
        return [m for _, m in self.sections]

    def set_snapshot(self, snap: Snapshot) -> None:
        groups = snap.kv_groups
        self.primary.set_snapshot(snap)
        while len(self.sections) < max(len(groups), 1):
            bmap = BlockMap()
            bmap.set_mode(self.primary.mode())
            bmap.set_selected(self._selected)
            self._add_section(bmap)
        for i, (title, bmap) in enumerate(self.sections):
            shown = i < max(len(groups), 1)
            title.parentWidget().setVisible(shown)
            title.setVisible(bool(groups))
            if groups and shown:
                title.setText(group_title(groups[i]))
            if i and shown:
                bmap.set_snapshot(dataclasses.replace(snap, tiers=groups[i]["tiers"]))

    def set_selected(self, seq_id: int) -> None:
        self._selected = int(seq_id)
        for bmap in self.maps():
            bmap.set_selected(seq_id)

    def set_mode(self, name: str) -> None:
        for bmap in self.maps():
            bmap.set_mode(name)
