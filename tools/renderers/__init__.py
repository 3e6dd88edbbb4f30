"""The renderers of ``tools/report.py``, one module per area: each turns one results document
(``bench/results/<name>.json``) into the lines of its generated block, the provenance line excepted (the mechanism
in ``tools/report.py`` adds it). ``common.claims_table`` is the claims table they share."""
