"""The README's table of Hugging Face architectures is the zoo's own (``hf_zoo.readme_table``),
whose engines ``test_hf_zoo.py`` asserts."""

from __future__ import annotations

from pathlib import Path

from walkserve.adapters import hf_zoo


def test_readme_holds_the_zoo_table() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert hf_zoo.readme_table() in readme
