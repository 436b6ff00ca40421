"""churnsim: which recovery method reaches your target loss first when pipeline stages fail.

Subpackages: `churnsim.calibration` (the file contract), `churnsim.sim` (SimPy simulator),
`churnsim.real` (PyTorch pipeline runs), `churnsim.figures` (plots from saved results).
"""

__version__ = "0.1.0"
