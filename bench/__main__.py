"""`python -m bench FIGURE`: one subcommand per figure of BENCHMARKS.md (figures.py); `python -m bench records`: the
records behind them, and which are stale (records.py)."""
import sys

if sys.argv[1:2] == ["records"]:
    from bench.records import main
    sys.exit(main(sys.argv[2:]))
from bench.figures import main

main()
