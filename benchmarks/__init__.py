"""Fork-versus-upstream benchmarks (see benchmarks/README.md);
``python -m benchmarks --help`` lists the jobs."""


class BenchError(RuntimeError):
    """A usage or setup error, printed without a traceback."""
