"""examples/quickstart.ipynb executed in a real Jupyter kernel (nbclient, ipykernel), cell by cell, each cell's
output checked: the run's lines without carriage returns, the metrics table, the figure, the trained policy's
reply, the exported folder; and the run it made learned."""
import json

from helpers import ROOT, SCRIPT_ENV, metric_rows, needs_vllm

NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def text(cell) -> str:
    return "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")


@needs_vllm
def test_the_quickstart_notebook_runs_in_a_kernel_and_its_run_learns(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    for key, value in SCRIPT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "commit it without outputs"
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    data, training, table, figure, reply, export = cells
    assert "48 prompts; the first: TITLE: post 0" in text(data)
    log = text(training)
    assert "batch plan:" in log and "run directory:" in log and "\r" not in log  # plain lines, no progress bar
    assert any("text/html" in out.get("data", {}) for out in table.outputs)  # the DataFrame, as notebooks show it
    assert any("image/png" in out.get("data", {}) for out in figure.outputs)
    assert text(reply).startswith("'")
    assert "'README.md'" in text(export) and "'config.json'" in text(export) and "## Evaluation" in text(export)
    run_dir = next((tmp_path / "outputs").glob("*/*"))
    rows = metric_rows(run_dir)
    rewards = [float(r["reward"]) for r in rows if r.get("reward")]
    assert len(rewards) == 20 and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.5
    evaluated = [float(r["eval/reward"]) for r in rows if r.get("eval/reward")]
    assert len(evaluated) >= 2 and json.loads((tmp_path / "my-model" / "config.json").read_text())["model_type"]
