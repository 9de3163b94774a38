"""Sphinx configuration of hvdcomp's documentation: the Markdown pages of docs/ (MyST) and an API
reference generated from the docstrings.

Sphinx rather than MkDocs: the docstrings are Google style (napoleon reads them) and cross-reference
with Sphinx roles (:class:, :meth:, :func:), which autodoc resolves and ``-n`` checks; MkDocs'
mkdocstrings would render those roles as literal text.

Build: ``python -m sphinx -W -n --keep-going -b html docs build/docs`` (tests/test_docs.py does it).
"""
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))

project = "hvdcomp"
author = "hvdcomp developers"
copyright = "hvdcomp developers"
from hvdcomp import __version__ as release  # noqa: E402
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_parser",
    "hvdcomp_xref",        # docs/_ext: references by Python name; |x| as maths
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = ["_build"]

# ---- API reference --------------------------------------------------------------------------------
# docs/api/ is generated (and git-ignored): start from an empty one, so a module that was renamed or
# removed leaves no stale page behind (it would fail the -W build with "failed to import")
shutil.rmtree(os.path.join(ROOT, "docs", "api"), ignore_errors=True)
autosummary_generate = True
autosummary_ignore_module_all = True       # (lists the submodules; automodule still follows __all__)
autosummary_imported_members = False
autosummary_mock_imports = ["hvdcomp.native.__main__"]   # (a command: importing it runs it)
autodoc_default_options = {"members": True, "show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_custom_sections = [("Class attributes", "params_style"), ("Payload", "notes_style"),
                            ("State", "notes_style")]

# ---- MyST: the existing Markdown pages, as they are ------------------------------------------------
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 4                    # links such as numerics.md#saturation-and-clipping-...
# heading levels that skip one (H1 then H3) in the generated reports of docs/results: harmless
suppress_warnings = ["myst.header"]

# ---- nitpicky (-n): objects of other projects (no internet, so no intersphinx) ---------------------
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|horovod|hvd|mpi4py|MPI|yaml|tqdm)(\..*)?"),
    (r"py:.*", r"(typing|collections|abc|enum|dataclasses|concurrent|threading|contextlib|pathlib|os)(\..*)?"),
]



def _results_are_orphans(app, docname, source):
    """docs/results/ holds the measurements' generated reports: pages reached through the links of
    the guides (results.md and each mode's page), not entries of the table of contents."""
    if docname.startswith("results/") and not source[0].startswith("---"):
        source[0] = "---\norphan: true\n---\n" + source[0]


def setup(app):
    app.connect("source-read", _results_are_orphans)


html_theme = "alabaster"
html_title = f"hvdcomp {release}"
