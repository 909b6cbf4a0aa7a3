"""The walkthrough notebook is committed executed, with its outputs; the test runs it again from
top to bottom on the same generated log (so it cannot rot) and compares what it printed with the
committed outputs (so they cannot go stale). ``python tests/test_notebook.py`` executes it and
saves it with fresh outputs."""

from __future__ import annotations

import os
import re
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "walkthrough.ipynb")
LOG = dict(world_size=4, steps=6, straggler=3, p2p=True, mismatch=(1, 9))  # the log the outputs are of
MAX_BYTES = 500_000


def execute(directory: str):
    """The notebook executed on a fresh log written in ``directory`` (its outputs in its cells)."""
    import nbclient
    import nbformat
    from jupyter_client import KernelManager

    from commpatch.testing import write_rank_files

    logs = os.path.join(directory, "logs")
    write_rank_files(logs, **LOG)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    before = os.environ.get("COMMPATCH_LOGS")
    os.environ["COMMPATCH_LOGS"] = logs  # the kernel inherits it
    # the kernel over Unix sockets in ``directory``: no TCP port taken
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(directory, "kernel"))
    try:
        nbclient.NotebookClient(nb, km=km, timeout=120, resources={"metadata": {"path": directory}}).execute()
    finally:
        if before is None:
            del os.environ["COMMPATCH_LOGS"]
        else:
            os.environ["COMMPATCH_LOGS"] = before
    for cell in nb.cells:  # timestamps of the execution: not part of the outputs
        cell.metadata.pop("execution", None)
    return nb


def _normal(text: str) -> str:
    """Temporary paths and times out: what stays is what the notebook says."""
    text = re.sub(r"(/tmp|/var/folders|/private/var|[A-Za-z]:\\)[^\s'\"]*", "<path>", text)
    return re.sub(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2})?\S*", "<time>", text)


def printed(nb) -> list[list[str]]:
    """Per code cell, what it printed (commpatch's own text: findings, the report, file names), and
    the kind of each result (a table, an image, or its text when it is neither: pandas' table
    layout changes between versions)."""
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        parts = []
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                parts.append(_normal(o.text))
            elif o.output_type == "error":
                parts.append(f"error: {o.ename}")
            else:
                data = o.get("data", {})
                kind = "<image/png>" if "image/png" in data else "<table>" if "text/html" in data else None
                parts.append(kind or _normal(data.get("text/plain", "")))
        out.append(parts)
    return out


@pytest.mark.slow
def test_walkthrough_notebook_executes_and_its_committed_outputs_are_current(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    nb = execute(str(tmp_path))
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "from ranks [0, 1, 2, 3]" in text
    assert "ERROR: bytes mismatch in group 0 at collective #10" in text
    assert "stragglers first" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3

    committed = nbformat.read(NOTEBOOK, as_version=4)
    fresh, kept = printed(nb), printed(committed)
    assert all(kept), "the committed notebook has a code cell without outputs: run python tests/test_notebook.py"
    assert fresh == kept, (
        "the committed notebook's outputs are stale: run python tests/test_notebook.py\n" + _first_change(kept, fresh)
    )


def _first_change(kept, fresh) -> str:
    """The first line that differs between two notebooks' outputs, with its cell and line."""
    import difflib

    for i, (a, b) in enumerate(zip(kept, fresh)):
        if a != b:
            diff = difflib.unified_diff(
                "\n".join(a).splitlines(), "\n".join(b).splitlines(), "committed", "now", n=1, lineterm=""
            )
            return f"code cell {i}:\n" + "\n".join(list(diff)[:12])
    return f"{len(kept)} code cells committed, {len(fresh)} now"


def test_the_committed_notebook_has_its_outputs_and_stays_small():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.get("outputs") for cell in code), "run python tests/test_notebook.py"
    assert all(cell.get("execution_count") for cell in code)
    text = "".join(o.get("text", "") for cell in code for o in cell.outputs if o.output_type == "stream")
    assert "ERROR: bytes mismatch in group 0 at collective #10" in text and "commpatch.open" in nb.cells[1].source
    assert _normal(text) == text, "the committed outputs name temporary paths or times"
    assert os.path.getsize(NOTEBOOK) < MAX_BYTES


if __name__ == "__main__":  # python tests/test_notebook.py: execute the notebook and save its outputs
    import nbformat

    sys.path.insert(0, ROOT)
    with tempfile.TemporaryDirectory() as directory:
        nbformat.write(execute(directory), NOTEBOOK)
    print(f"{NOTEBOOK}: executed and saved ({os.path.getsize(NOTEBOOK) / 1e3:.0f} kB)")
