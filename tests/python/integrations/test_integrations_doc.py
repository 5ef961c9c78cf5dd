"""The python blocks of docs/integrations.md run as shown (the project's docs
check only parses them): the Trainer block trains a tiny Llama with
HipferryTrainer, the TRL block builds its SFTConfig."""
import contextlib
import io
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")

DOC = Path(__file__).resolve().parents[3] / "docs" / "integrations.md"


def python_blocks():
    blocks, inside, body = [], False, []
    for line in DOC.read_text().split("\n"):
        if line.strip() == "```python":
            inside, body = True, []
        elif inside and line.startswith("```"):
            inside = False
            blocks.append("\n".join(body))
        elif inside:
            body.append(line)
    return blocks


def test_the_python_blocks_of_the_integrations_doc_run(tmp_path, monkeypatch):
    blocks = python_blocks()
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    for i, code in enumerate(blocks):
        code = code.replace("/tmp/", f"{tmp_path}/")
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{DOC.name} python block {i}", "exec"), {"__name__": "__doc_block__"})
    lines = [ln for ln in out.getvalue().split("\n") if ln.startswith(("OffloadAdamW", "HipferryTrainerMixin"))]
    assert lines[0].startswith("OffloadAdamW ") and float(lines[0].split()[1]) > 0, out.getvalue()
    assert lines[1] == "HipferryTrainerMixin state=host8,activations=hipferry"
