"""Project tools that are neither the app nor a benchmark: the mutation tester and the docs renderer."""
