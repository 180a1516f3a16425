"""`python -m infermux` runs the command line."""

from infermux.cli import main

main()
