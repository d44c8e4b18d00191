"""`python -m bench FIGURE`: one subcommand per figure of BENCHMARKS.md (figures.py); `python -m bench records`: the
records behind them, and which are stale (records.py); `python -m bench ops`: the operations a training step issues
(ops.py)."""
import sys

if sys.argv[1:2] == ["records"]:
    from bench.records import main
    sys.exit(main(sys.argv[2:]))
if sys.argv[1:2] == ["ops"]:
    from bench.ops import main
    sys.exit(main(sys.argv[2:]))
from bench.figures import main

main()
