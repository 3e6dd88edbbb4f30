"""Benchmarks that need Docker: the chaos proof and the failure drills of the compose cluster."""
