"""`python -m churnsim` runs the command line."""

from churnsim.cli import main

main()
