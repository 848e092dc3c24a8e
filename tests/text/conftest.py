from __future__ import annotations

from pathlib import Path

import pytest

from trio_enginecore.text import Tokenizer, load_tokenizer

from .tokenizers_for_tests import write_tricky_dir


@pytest.fixture(scope="session")
def tricky_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained byte-level BPE with multi-byte pieces and special tokens."""
    return write_tricky_dir(tmp_path_factory.mktemp("tricky"))


@pytest.fixture(scope="session")
def tricky(tricky_dir: Path) -> Tokenizer:
    return load_tokenizer(tricky_dir)
