"""examples/quickstart.ipynb runs headless (CPU: virtual world in the interpreter) and plots."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_quickstart_notebook_executes():
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=540, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "relative error per rank" in text
    assert "benchmark rows plotted" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot was not rendered"
