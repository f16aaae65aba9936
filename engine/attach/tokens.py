"""Token ids to text for the attach window's tooltips, with the served model's tokenizer when the user gives
one (`--tokenizer DIR` with a tokenizer.json, or the .json file itself). Uses the `tokenizers` library alone:
no transformers, no torch, nothing fetched."""

from __future__ import annotations

import os

from tokenizers import Tokenizer


class TokenText:
    def __init__(self, path: str):
        f = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(f):
            raise OSError(f"--tokenizer {path}: no tokenizer.json there (give the model's directory or the file)")
        try:
            self._tok = Tokenizer.from_file(f)
        except Exception as e:  # the tokenizers library raises its own Exception type for a bad file
            raise OSError(f"--tokenizer {path}: not a tokenizers file ({e})") from None
        self.path = f

    def decode(self, ids: list[int]) -> str:
        try:
            return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
        except Exception:  # ids outside the vocabulary (a different model's cache)
            return "<ids outside this tokenizer's vocabulary>"
