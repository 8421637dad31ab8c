"""`python -m dmattn_bench` runs the command line."""

from dmattn_bench.cli import main

main()
