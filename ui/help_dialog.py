"""The Help menu's window: one help topic (assets/help/*.md, ui/help_text.py) rendered from its markdown, the same
text `kvscope help TOPIC` prints."""

from __future__ import annotations

from PySide6 import QtWidgets

from ui.help_text import HELP_DIR, topic_text, topics


class HelpDialog(QtWidgets.QDialog):
    """A topic's text, read-only and scrollable; one dialog per window, re-used for the next topic asked."""

    def __init__(self, parent: QtWidgets.QWidget | None = None):
        super().__init__(parent)
        self.resize(760, 560)
        self.view = QtWidgets.QTextBrowser(self)
        self.view.setOpenExternalLinks(True)
        self.view.setSearchPaths([str(HELP_DIR.parent.parent)])  # a topic's pictures: paths from the checkout's root
        lay = QtWidgets.QVBoxLayout(self)
        lay.addWidget(self.view)
        self.topic = ""

    def show_topic(self, name: str) -> None:
        self.topic = name
        self.view.setMarkdown(topic_text(name))
        self.setWindowTitle(f"KV Scope help: {name}")
        self.show()
        self.raise_()


def add_help_menu(window: QtWidgets.QMainWindow) -> QtWidgets.QMenu:
    """Help > one entry per topic (its one-line summary as the tooltip), each shown in the window's HelpDialog."""
    menu = window.menuBar().addMenu("&Help")
    window.help_dialog = None  # made at the first topic asked

    def show(name: str) -> None:
        if window.help_dialog is None:
            window.help_dialog = HelpDialog(window)
        window.help_dialog.show_topic(name)

    menu.setToolTipsVisible(True)
    for name, summary in topics():
        act = menu.addAction(name, lambda n=name: show(n))
        act.setToolTip(summary)
    return menu
