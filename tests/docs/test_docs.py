"""The documents in the repository: every link stays inside it and leads to a file that is
there, and the README's sample of the `qmq ready` line has the real line's keys in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qmq.testing import ReadyProcess

ROOT = Path(__file__).resolve().parents[2]
# [text](target) of markdown; a target may carry a #fragment
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_EXTERNAL = ("http://", "https://", "mailto:")
# directories that are not the project's documents: tools' caches, venvs, builds
_SKIPPED_PARTS = ("node_modules", "site", "build", "dist")


def _documents() -> list[Path]:
    found = []
    for path in sorted(ROOT.rglob("*.md")):
        parts = path.relative_to(ROOT).parts
        if any(p.startswith(".") or p.endswith(".egg-info") or p in _SKIPPED_PARTS for p in parts[:-1]):
            continue
        found.append(path)
    return found


def test_every_link_of_every_document_leads_to_a_file_of_the_repository() -> None:
    documents = _documents()
    assert ROOT / "README.md" in documents
    assert ROOT / "docs" / "contributing.md" in documents
    broken = []
    for doc in documents:
        text = doc.read_text(encoding="utf-8")
        if "../shared" in text:
            broken.append(f"{doc.relative_to(ROOT)} names ../shared, which is not part of the repository")
        for target in _LINK.findall(text):
            if target.startswith(_EXTERNAL) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{doc.relative_to(ROOT)} links {target}, which is not a file of the repository")
    assert broken == []


def test_the_readme_links_the_contributing_page_and_the_api_reference() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/contributing.md)" in readme
    assert "scripts/api_reference.py" in readme
    assert (ROOT / "scripts" / "api_reference.py").exists()


@pytest.mark.integration
def test_the_readme_ready_line_has_the_real_keys_in_order(shared_standalone: ReadyProcess) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    [line] = [ln for ln in readme.splitlines() if ln.startswith("qmq ready meta_server=")]
    keys = [part.split("=", 1)[0] for part in line.split()[2:]]
    assert keys == list(shared_standalone.ready)
