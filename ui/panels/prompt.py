"""The prompt panel: type a prompt, send it to the engine, and read the model's reply as it streams."""

from __future__ import annotations

import html

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from ui.panels.knob import SPIN_ARROWS


class PromptPanel(QtWidgets.QWidget):
    submitted = QtCore.Signal(str, bool, int)
    TRANSCRIPT_LINES = 6  # the reply shows at least this many lines

    @staticmethod
    def lines_tall(edit: QtWidgets.QAbstractScrollArea, lines: int) -> int:
        """The height that shows `lines` lines of the edit's text, with its frame and margins."""
        fm = edit.fontMetrics()
        return lines * fm.lineSpacing() + 2 * edit.frameWidth() + 10

    def __init__(self):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.transcript = QtWidgets.QTextBrowser()
        self.transcript.setStyleSheet("font-size: 9pt;")
        self.transcript.setMinimumHeight(self.lines_tall(self.transcript, self.TRANSCRIPT_LINES))
        self.input = QtWidgets.QPlainTextEdit()
        self.input.setPlaceholderText("Type a prompt and press Send (Ctrl+Enter)")
        self.input.setMinimumHeight(self.lines_tall(self.input, 2))
        self.input.setMaximumHeight(self.lines_tall(self.input, 4))
        row = QtWidgets.QHBoxLayout()
        self.chat = QtWidgets.QCheckBox("chat")
        self.chat.setChecked(True)
        self.max_new = QtWidgets.QSpinBox()
        self.max_new.setRange(1, 4096)
        self.max_new.setValue(96)
        self.max_new.setPrefix("max ")
        self.max_new.setStyleSheet(SPIN_ARROWS)  # arrows that show on the dark style
        self.send = QtWidgets.QPushButton("Send")
        row.addWidget(self.chat)
        row.addWidget(self.max_new)
        row.addStretch(1)
        row.addWidget(self.send)
        # Where the prompt sent last is until its first token: a loaded engine may keep it waiting for
        # admission tens of seconds, with nothing else on screen to say so.
        self.queue = QtWidgets.QLabel()
        self.queue.setStyleSheet("color: #ffb74d;")
        self.queue.setToolTip("the prompt sent last waits for the scheduler to admit it: its place among the "
                              "waiting sequences (first come, first admitted), until its first token")
        self.queue.hide()
        lay.addWidget(self.transcript, 3)
        lay.addWidget(self.queue)
        lay.addWidget(self.input)
        lay.addLayout(row)
        self.send.clicked.connect(self._send)
        QtGui.QShortcut(QtGui.QKeySequence("Ctrl+Return"), self.input, activated=self._send)
        self.current = -1
        self._answered = True  # the current prompt has its first token (or there is none)

    def _send(self) -> None:
        text = self.input.toPlainText()
        self.submitted.emit(text, self.chat.isChecked(), self.max_new.value())

    def started(self, sid: int, text: str) -> None:
        self.current = sid
        self._answered = False
        self._set_queue("queued")
        self.input.clear()
        self.transcript.append(f"<p><b>you (seq {sid}):</b> {html.escape(text)}</p><p><b>model:</b> ")

    def stream(self, pieces: list[tuple[int, str]]) -> None:
        text = "".join(p for sid, p in pieces if sid == self.current)
        if text:
            self._answered = True
            self._set_queue("")
            cur = self.transcript.textCursor()
            cur.movePosition(QtGui.QTextCursor.End)
            cur.insertText(text)
            self.transcript.setTextCursor(cur)

    def update_snapshot(self, seqs, engine_paused: bool = False) -> None:
        """Say where the prompt sent last is until its first token: "queued (position N of M)" while it waits
        for admission, "prefill…" once admitted (seqs: a snapshot's SeqTable)."""
        if self._answered or self.current < 0:
            return
        where = np.flatnonzero(seqs.id == self.current)
        if not len(where):
            self._set_queue("")
            return
        state = int(seqs.state[where[0]])
        if state == 0:  # waiting: preempted sequences go back to the queue's front, the others first come first
            waiting = np.sort(seqs.id[seqs.state == 0])
            ahead = int(np.count_nonzero(seqs.state == 3))
            pos = ahead + int(np.searchsorted(waiting, self.current)) + 1
            text = f"queued (position {pos} of {ahead + len(waiting)} waiting)"
        elif state == 3:
            text = "preempted: waiting to run again"
        elif state == 4:
            text = ""
        else:
            text = "prefill…"
        if engine_paused and text:
            text += " — the engine is paused"
        self._set_queue(text)

    def _set_queue(self, text: str) -> None:
        if text != self.queue.text():
            self.queue.setText(text)
        self.queue.setVisible(bool(text))

    def error(self, message: str) -> None:
        self.transcript.append(f"<p style='color:#e57373'>{message}</p>")
