"""The benchmarks: the timings BENCHMARKS.md quotes, apart from the lesson and from the plumbing (`python -m bench`)."""
