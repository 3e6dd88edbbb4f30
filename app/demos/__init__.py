"""The proofs a person runs: ``demo`` (``make demo``: N ranks against one process, step by step) and
``pipeline_demo`` (``make pipeline``: model parallel, GPipe, 1F1B, data x pipeline, tensor parallel), with
``world`` (spawn a local world of processes) and ``bubble`` (the pipeline's idle share) that the benches reuse.
"""
