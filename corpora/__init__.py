"""The corpus catalog shipped with zlm (installed as the package `zlm.corpora`).

`catalog.json` names the corpora `zlm prepare` knows: their files, SHA-256 digests,
download URLs, formats and split conventions. It is package data, read through
importlib.resources so it loads the same from a checkout, an editable install or a wheel.
`zlm.data.catalog` interprets it.
"""

from __future__ import annotations

import json
from importlib import resources


def load_catalog() -> dict:
    """The parsed catalog.json: {"format", "version", "notes", "corpora": {name: entry}}."""
    text = resources.files(__name__).joinpath("catalog.json").read_text(encoding="utf-8")
    return json.loads(text)
