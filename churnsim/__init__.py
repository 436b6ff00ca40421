"""churnsim: which recovery method reaches your target loss first when pipeline stages fail.

Subpackages: `churnsim.calibration` (the file contract), `churnsim.sim` (SimPy simulator),
`churnsim.real` (PyTorch pipeline runs), `churnsim.figures` (plots from saved results).
"""

__version__ = "0.1.0"


def installed_version() -> str:
    """The installed distribution's version (pyproject.toml), or `__version__` when running from a bare checkout."""
    from importlib import metadata

    try:
        return metadata.version("churnsim")
    except metadata.PackageNotFoundError:
        return __version__
