"""`python -m durably_py`: the `durably` command line."""

from .launcher import main

main()
