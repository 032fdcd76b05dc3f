"""tpcomm's version (pyproject.toml's [project] version must equal it)."""

__version__ = "0.2.0"
