"""Fork-versus-upstream benchmarks (see benchmarks/README.md)."""
