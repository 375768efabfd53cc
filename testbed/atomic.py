"""Files that a reader in another process may open at any moment: written whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: str | Path, data, indent: int | None = None) -> None:
    """``path`` holds ``data`` as JSON, never part of it: written to a temporary file beside
    it (named after this process, so that two writers never share one) and renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=indent))
    os.replace(tmp, path)
