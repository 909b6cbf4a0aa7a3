"""The walkthrough notebook runs from top to bottom on a freshly generated log (so it cannot rot)."""

import os

import pytest

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "walkthrough.ipynb")


@pytest.mark.slow
def test_walkthrough_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    from commpatch.testing import write_rank_files

    logs = tmp_path / "logs"
    write_rank_files(str(logs), 4, 6, straggler=3, p2p=True, mismatch=(1, 9))
    monkeypatch.setenv("COMMPATCH_LOGS", str(logs))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "from ranks [0, 1, 2, 3]" in text
    assert "ERROR: bytes mismatch in group 0 at collective #9" in text
    assert "stragglers first" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3
