"""The exit codes of every process this project starts, named once: the trainer, the launchers, the store.

Kubernetes, Docker's restart policy and torchrun's elastic agent act on these numbers, so each means one thing
everywhere. Torch-free: the launchers read them before torch is imported.
"""

OK = 0  # finished, or stopped on request after checkpointing (SIGTERM/SIGINT handled)
FAILED = 1  # anything else: a crash, a lost store, a non-finite loss (the last good checkpoint stays the newest)
BAD_CONFIG = 2  # a setting or input is wrong: retrying cannot help, fix the named field
# A pod's trainer was killed over the pod's memory limit (app.cluster.memory): the same run would be killed again, so
# the Job fails at once (podFailurePolicy) instead of spending backoffLimit. The compose launcher, which Docker does
# not restart, ends such a container with FAILED and the same one line.
OUT_OF_MEMORY = 3
# sysexits' EX_IOERR: the checkpoint directory cannot take a checkpoint (no space, no permission). A retry would
# train up to the next checkpoint and fail there again: the launcher gives up at once (exit 1) instead.
STORAGE_FAILED = 74
PEER_STOPPED = 75  # sysexits' EX_TEMPFAIL: this rank stopped because a peer did; re-form the world without it
STOPPED_BY_SIGNAL = 143  # 128 + SIGTERM: what a container stopped by its signal reports (the Kubernetes pods)
