"""`python -m durably_py`: the `durably` command line."""

from .cli import main

main()
