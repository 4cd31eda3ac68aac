"""`python -m durably_py`: the `durably` command line."""

from ._launcher import main

main()
