"""File → Attach…: ask where the servers are, then open an attach window on them (read-only).

One endpoint per line, as on the command line (`kvscope attach --vllm ...`):
`vllm tcp://10.0.0.5:5557,dp=2,metrics=http://10.0.0.5:8000/metrics` or `sglang tcp://10.0.0.6:5557`.
A line that does not parse keeps the dialog open and says why.
"""

from __future__ import annotations

from PySide6 import QtWidgets

from engine.attach.source import KINDS, SourceError, check_distinct, parse_metrics_url, parse_source

PLACEHOLDER = ("vllm tcp://10.0.0.5:5557,metrics=http://10.0.0.5:8000/metrics\n"
               "vllm tcp://10.0.0.7:5557,dp=2,replay=tcp://10.0.0.7:5600\n"
               "sglang tcp://10.0.0.6:5557")


def parse_lines(text: str) -> list:
    """Every non-empty line "KIND ENDPOINT[,opts]" as SourceSpecs; SourceError names the line."""
    specs = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        kind, _, rest = line.partition(" ")
        if kind not in KINDS or not rest.strip():
            raise SourceError(f"line {n}: start with {' or '.join(KINDS)} and an endpoint, e.g. vllm tcp://HOST:5557")
        try:
            specs += parse_source(kind, rest.strip())
        except SourceError as e:
            raise SourceError(f"line {n}: {e}") from None
    check_distinct(specs)  # as the command line: an endpoint twice would count its events twice
    return specs


class AttachDialog(QtWidgets.QDialog):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Attach to vLLM / SGLang servers")
        self.sources = QtWidgets.QPlainTextEdit()
        self.sources.setPlaceholderText(PLACEHOLDER)
        self.sources.setToolTip("one KV-event publisher per line: vllm|sglang tcp://HOST:PORT, then options after "
                                "commas: replay=, topic=, dp=, name=, metrics=")
        self.metrics = QtWidgets.QLineEdit()
        self.metrics.setPlaceholderText("more /metrics URLs, separated by spaces (optional)")
        self.tokenizer = QtWidgets.QLineEdit()
        self.tokenizer.setPlaceholderText("the served model's tokenizer.json or its folder (optional)")
        browse = QtWidgets.QPushButton("…")
        browse.clicked.connect(self._browse)
        tok = QtWidgets.QHBoxLayout()
        tok.addWidget(self.tokenizer, 1)
        tok.addWidget(browse)
        self.error = QtWidgets.QLabel()
        self.error.setStyleSheet("color: #ff6b6b")
        self.error.setWordWrap(True)
        note = QtWidgets.QLabel("Read-only: KV Scope connects to the servers' event and replay sockets and GETs "
                                "/metrics; it never binds a port or writes to a server.")
        note.setWordWrap(True)
        buttons = QtWidgets.QDialogButtonBox(QtWidgets.QDialogButtonBox.Ok | QtWidgets.QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form = QtWidgets.QFormLayout(self)
        form.addRow("Endpoints", self.sources)
        form.addRow("Metrics", self.metrics)
        form.addRow("Tokenizer", tok)
        form.addRow(note)
        form.addRow(self.error)
        form.addRow(buttons)
        self.resize(640, 320)
        self.result_value: tuple | None = None

    def _browse(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self, "Tokenizer", "", "tokenizer.json (*.json)")
        if path:
            self.tokenizer.setText(path)

    def parsed(self) -> tuple[list, list[str], object]:
        """(specs, metrics URLs, TokenText or None); SourceError / OSError say what is wrong."""
        specs = parse_lines(self.sources.toPlainText())
        urls = [parse_metrics_url(u) for u in self.metrics.text().replace(",", " ").split()]
        if not specs and not urls:
            raise SourceError("give at least one endpoint (or a /metrics URL)")
        tokens = None
        if self.tokenizer.text().strip():
            from engine.attach.tokens import TokenText

            tokens = TokenText(self.tokenizer.text().strip())
        return specs, urls, tokens

    def accept(self) -> None:
        try:
            self.result_value = self.parsed()
        except (SourceError, OSError) as e:
            self.error.setText(str(e))
            return
        super().accept()


def open_attach_window(parent=None, in_process: bool = False, dialog: AttachDialog | None = None):
    """Ask (unless a filled `dialog` is given, for tests), then show an attach window that owns its session.
    Returns the window, or None when cancelled or the session could not start (said in a message box)."""
    from engine.attach.session import AttachSession
    from engine.attach.worker import AttachClient, WorkerError
    from ui.attach.window import AttachWindow

    dlg = dialog or AttachDialog(parent)
    if dialog is None and dlg.exec() != QtWidgets.QDialog.Accepted:
        return None
    if dlg.result_value is None:
        dlg.accept()
        if dlg.result_value is None:
            return None
    specs, urls, tokens = dlg.result_value
    try:
        session = AttachSession(specs, urls).start() if in_process else AttachClient(specs, urls)
    except (ValueError, OSError, WorkerError) as e:
        QtWidgets.QMessageBox.warning(parent, "KV Scope", f"Cannot attach: {e}")
        return None
    win = AttachWindow(session, tokens, owns_session=True)
    if parent is not None:  # keep it alive as long as the main window
        parent.__dict__.setdefault("_attach_windows", []).append(win)
    win.show_fitted()
    return win
