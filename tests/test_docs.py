"""The documentation names only what exists: every relative link and every file path written in code style in
README.md and docs/*.md points at a file or folder of this repository, and the README stays short (≤ 200 lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE = ROOT / "src" / "terapipe_cli"
# A path in code style: folders and a file name with an extension, e.g. `schedule/schedule.py`, `tests/cli/x.py`.
CODE_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|toml|json|csv|sh|md|png))`")
PLACEHOLDER = re.compile(r"\*|_N+\b|\b[A-Z]{3,}\b")  # rank_N.json, RUN/report, step_NNNNNN/
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _exists(doc: Path, path: str) -> bool:
    candidates = [doc.parent / path, ROOT / path, PACKAGE / path, ROOT / "src" / path]
    return any(c.exists() for c in candidates)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_and_link_exists(doc: Path):
    text = doc.read_text()
    named = set(CODE_PATH.findall(text)) | {t for t in LINK.findall(text) if "://" not in t}
    named = {p for p in named if not PLACEHOLDER.search(p)}
    missing = sorted(p for p in named if not _exists(doc, p))
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_the_readme_is_short_and_names_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
