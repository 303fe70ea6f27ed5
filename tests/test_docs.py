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


def test_the_readme_demo_trains_two_ranks_with_live_progress():
    """The README's first command (after its set-up): a real 2-rank CPU training."""
    import subprocess
    import sys

    assert "-m nblaunch.demo" in README.read_text().split("\n## ")[0]
    out = subprocess.run([sys.executable, "-m", "nblaunch.demo", "--epochs", "2"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[nblaunch] starting 2 ranks" in out.stdout
    assert "[rank 0] epoch 2/2: loss" in out.stdout
    assert re.search(r"\[nblaunch\] finished in [\d.]+ s \| rank 0 finished epoch 2/2", out.stdout), out.stdout[-2000:]
    assert "final loss per rank: [" in out.stdout
