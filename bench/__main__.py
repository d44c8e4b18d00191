"""`python -m bench FIGURE`: one subcommand per figure of BENCHMARKS.md (figures.py)."""
from bench.figures import main

main()
