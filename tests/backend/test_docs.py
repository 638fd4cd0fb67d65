"""The Python lines docs/backend.md shows a newcomer run as they are."""

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_the_shell_examples_in_the_backend_doc_run():
    doc = Path(ROOT / "docs" / "backend.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert len(blocks) == 3
    script = "\n".join(blocks) + "\nassert piece.finish_reason == 'length'\n"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "StepOutput(pieces=[Piece(request_id='r1'" in result.stdout
