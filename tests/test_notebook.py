"""notebooks/quickstart.ipynb runs top to bottom on the CPU, says what it plots, and writes nothing into
the repository."""

import ast
import os
import re

import nbformat
from conftest import REPO
from nbclient import NotebookClient


def _tree(path: str) -> set[str]:
    return {os.path.join(d, f) for d, _, files in os.walk(path) for f in files}


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nb = nbformat.read(os.path.join(REPO, "notebooks", "quickstart.ipynb"), as_version=4)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # its temporary directory, removed with the test's
    monkeypatch.delenv("QERL_NOTEBOOK_DIR", raising=False)
    runs = os.path.join(REPO, "runs")
    before = _tree(runs)
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": os.path.join(REPO, "notebooks")}}
    ).execute()
    assert _tree(runs) == before  # nothing written into the repository (it used to be runs/notebook)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"writing to {tmp_path}" in outputs
    assert "KL(bf16 || nvfp4) per token:" in outputs
    # The text above the plot says the tiny run's digits reward rises from about 0.1 over its 4 steps.
    assert "the reward rises from about 0.1" in "".join(c.source for c in nb.cells if c.cell_type == "markdown")
    rewards = ast.literal_eval(re.search(r"reward/mean by step: (\[.*?\])", outputs).group(1))
    assert len(rewards) == 4 and abs(rewards[0] - 0.1) < 0.05 and rewards[-1] > rewards[0], rewards
    # the SmolLM2 (GGUF) section ran; its experiment plot is skipped with a message until results exist
    curves = os.path.join(REPO, "experiments", "fidelity", "results", "curves.json")
    assert os.path.isfile(curves) or "no experiment results yet" in outputs
    assert any(
        o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
