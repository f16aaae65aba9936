"""The prompt panel: type a prompt, send it to the engine, and read the model's reply as it streams."""

from __future__ import annotations

import html

from PySide6 import QtCore, QtGui, QtWidgets


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
        self.send = QtWidgets.QPushButton("Send")
        row.addWidget(self.chat)
        row.addWidget(self.max_new)
        row.addStretch(1)
        row.addWidget(self.send)
        lay.addWidget(self.transcript, 3)
        lay.addWidget(self.input)
        lay.addLayout(row)
        self.send.clicked.connect(self._send)
        QtGui.QShortcut(QtGui.QKeySequence("Ctrl+Return"), self.input, activated=self._send)
        self.current = -1

    def _send(self) -> None:
        text = self.input.toPlainText()
        self.submitted.emit(text, self.chat.isChecked(), self.max_new.value())

    def started(self, sid: int, text: str) -> None:
        self.current = sid
        self.input.clear()
        self.transcript.append(f"<p><b>you (seq {sid}):</b> {html.escape(text)}</p><p><b>model:</b> ")

    def stream(self, pieces: list[tuple[int, str]]) -> None:
        text = "".join(p for sid, p in pieces if sid == self.current)
        if text:
            cur = self.transcript.textCursor()
            cur.movePosition(QtGui.QTextCursor.End)
            cur.insertText(text)
            self.transcript.setTextCursor(cur)

    def error(self, message: str) -> None:
        self.transcript.append(f"<p style='color:#e57373'>{message}</p>")
