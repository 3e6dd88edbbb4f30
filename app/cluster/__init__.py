"""Cluster plumbing around the worker: how containers and pods become a world.

- ``launch``: the compose workers' entry point, elastic torchrun with one-line outcomes and exit codes;
- ``elastic``: the one home of torch's private elastic internals the launcher and the store rely on;
- ``job_state``: the launcher's records in the shared volume (refusals, the job's finish) that end restarts;
- ``compose_env``: every ``DDP_*`` variable of the caller, as the env file compose hands each worker;
- ``rendezvous_store``: the TCPStore server the compose workers rendezvous at;
- ``k8s_launch``: the Kubernetes pods' entry point (an Indexed Job: rank from the completion index).

It reads the worker's configuration (``app.worker.config``) to refuse bad settings before any rendezvous; the
worker never imports it.
"""
