"""churnsim: which recovery method reaches your target loss first when pipeline stages fail.

Subpackages: `churnsim.calibration` (the file contract), `churnsim.sim` (SimPy simulator),
`churnsim.real` (PyTorch pipeline runs), `churnsim.figures` (plots from saved results).
"""

import os as _os

__version__ = "0.1.0"

# In a checkout, `calibration/`, `sim/`, `real/` and `figures/` sit beside this folder; an install maps
# them into the package (pyproject.toml). When this folder is imported straight from a checkout (its
# root first on sys.path, as for `python -m churnsim` or a spawned process started there, even with
# churnsim installed), look for the subpackages beside it too, instead of failing to find them.
_PACKAGE_DIRECTORY = _os.path.dirname(_os.path.abspath(__file__))
_CHECKOUT_ROOT = _os.path.dirname(_PACKAGE_DIRECTORY)
if not _os.path.isdir(_os.path.join(_PACKAGE_DIRECTORY, "sim")) and _os.path.isfile(_os.path.join(_CHECKOUT_ROOT, "sim", "__init__.py")):
    __path__.append(_CHECKOUT_ROOT)


def installed_version() -> str:
    """The installed distribution's version (pyproject.toml), or `__version__` when running from a bare checkout."""
    from importlib import metadata

    try:
        return metadata.version("churnsim")
    except metadata.PackageNotFoundError:
        return __version__
