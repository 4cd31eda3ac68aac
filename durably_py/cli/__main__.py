"""`python -m durably_py.cli`: the `durably` command line."""

from . import main

main()
