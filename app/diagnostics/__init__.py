"""When a run hangs, stalls or diverges: which rank, which collective and why (docs/diagnostics.md).

- ``recorder.py``: the flight recorder, a bounded ring per process of every collective the project issues (``RECORDER``)
- ``desync.py``: the optional fingerprint check that stops at the first collective the ranks disagree on
- ``dumps.py`` and ``doctor.py``: the dumps read back and merged into one line and a table (``python -m app.doctor``)

Nothing here imports the training worker or ``app.parallel``: both call into it.
"""
