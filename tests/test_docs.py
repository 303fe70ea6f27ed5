"""The README's code runs as written: every block marked
``<!-- runs in tests/test_docs.py -->`` runs, in order, in one fresh kernel."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import Kernel

README = Path(__file__).resolve().parent.parent / "README.md"
MARK = "<!-- runs in tests/test_docs.py -->"

pytestmark = pytest.mark.timeout(300)


def marked_blocks() -> list[str]:
    return re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_code_runs_in_a_fresh_kernel():
    blocks = marked_blocks()
    assert len(blocks) >= 3  # the quick start and the cell magic, at least
    k = Kernel()
    try:
        for block in blocks:
            reply = k.execute(block, timeout=240)
            assert reply.error is None, f"{block}\n-> {reply.error.get('ename')}: {reply.error.get('evalue')}"
        results = k.execute("print(results)").stdout
        assert results.strip() == "[0.6000000238418579, 0.6000000238418579, 0.6000000238418579, 0.6000000238418579]"
    finally:
        k.shutdown()
