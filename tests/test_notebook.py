"""notebooks/gpt2_llmc_kernels.ipynb: valid, in step with its generator, every code cell compiles (CPU);
executed headless with no cell error (GPU machine, with nbclient and ipykernel installed)."""
from __future__ import annotations

import importlib.util
import os
import re

import pytest

from conftest import HAS_GPU, NO_GPU_REASON

nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "gpt2_llmc_kernels.ipynb")
BUILDER = os.path.join(ROOT, "notebooks", "build_notebook.py")


def builder():
    spec = importlib.util.spec_from_file_location("kforge_build_notebook", BUILDER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def code_of(cell_source: str) -> str:
    """A code cell as plain Python: IPython magics (%...) and shell escapes (!...) become `pass`."""
    return "\n".join(re.sub(r"^(\s*)[%!].*$", r"\1pass", line) for line in cell_source.splitlines())


def test_notebook_is_valid_nbformat():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"


def test_notebook_matches_its_generator():
    """The committed notebook's cells are the generator's (outputs may differ: it is committed run)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    built = builder().build()
    assert [(c.cell_type, c.source) for c in nb.cells] == [(c.cell_type, c.source) for c in built.cells], \
        "notebooks/gpt2_llmc_kernels.ipynb is stale: run `python notebooks/build_notebook.py`"


def test_every_code_cell_compiles():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert len(code) >= 10
    for i, cell in enumerate(code):
        compile(code_of(cell.source), f"<notebook code cell {i}>", "exec")


def test_magics_are_stripped_not_hidden():
    assert code_of("%matplotlib inline\nx = 1\n  !ls") == "pass\nx = 1\n  pass"
    with pytest.raises(SyntaxError):
        compile(code_of("x = (1,"), "<cell>", "exec")


def test_notebook_walks_the_whole_journey():
    text = "\n".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells)
    for needle in ("thunder.get_default_executors()", "executors=executors", "kforge.inspect", "tieout(",
                   "torch.compile", "plt.", "kforge.profile", "llama.Llama", "kforge.transforms.thunderfx"):
        assert needle in text, needle


@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.timeout(1800)
def test_notebook_executes_without_error(tmp_path):
    pytest.importorskip("nbclient", reason="nbclient is not installed (carry its wheel to the GPU machine)")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (carry its wheel to the GPU machine)")
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(NOTEBOOK, as_version=4)
    try:
        builder().execute(nb, timeout=900)
    except CellExecutionError as e:  # names the cell and carries its traceback
        pytest.fail(f"notebook cell failed:\n{e}")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    # The benchmark chart rendered as an image.
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    nbformat.write(nb, tmp_path / "executed.ipynb")
