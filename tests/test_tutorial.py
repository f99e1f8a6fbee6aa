"""docs/tutorial.ipynb runs top to bottom in a fresh kernel of this interpreter: it never rots."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "tutorial.ipynb"


def test_tutorial_notebook_executes(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the tutorial without outputs")
    from ipykernel.kernelspec import write_kernel_spec

    # a kernel spec that runs exactly this interpreter (the venv's), not whatever "python3" is
    write_kernel_spec(str(tmp_path / "kernels" / "kvplan-test"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="kvplan-test", resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # no progress lines or warnings land in the cells' output (explain runs for seconds there)
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr"]
    kinds = {k for o in outputs for k in o.get("data", {})}
    assert {"text/html", "image/png"} <= kinds
    assert any("'verified'" in o.get("data", {}).get("text/plain", "") for o in outputs)
