"""User models of the benchmarks: defined outside ``app/`` and reached through an import spec, as a user's own are."""
