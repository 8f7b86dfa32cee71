"""The file names of a checkpoint folder, apart from the layout code that plans them: the
readers, the command line and the rule language name these files without needing the rest
(``layout.py`` takes a few milliseconds to import, which ``weightmap inspect`` would pay)."""

from __future__ import annotations

__all__ = ["CONFIG_NAME", "INDEX_NAME", "JOURNAL_NAME", "SINGLE_NAME"]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# An in-place rewrite's journal (see execute/inplace.py); its presence means one was interrupted.
JOURNAL_NAME = ".weightmap-inplace-journal.json"
