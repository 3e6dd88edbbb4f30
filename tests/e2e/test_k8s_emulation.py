"""The Kubernetes Job, run for real without Kubernetes: its pod template as N Docker containers.

Why: no cluster can run here, yet the wiring of k8s/ (torchrun's node rank from the completion index, the
rendezvous at pod 0 through the headless Service's DNS name, the env the trainer reads, the volumes, the
security context, the metrics port Prometheus is told about) is only proven when it trains. So this test takes
what `kubectl apply -k k8s/cpu/` sends (the CPU/gloo variant, the one kind/minikube run, rendered by
`kubectl kustomize`; tests/unit/test_k8s.py checks that the GPU default differs from it only in GPU settings),
renders pod i the way the Job controller and kubelet would (tests/unit/test_k8s.py:render_pod), and starts it
from the `ddp-cluster:latest` image on a Docker network where each container answers to exactly the pod's DNS
names (ddp-train-i.ddp-train, and the namespace-qualified forms):

- command + args as written in the manifest, $(VAR) expanded from the pod's env;
- env as the kubelet builds it (downward API fields, resource limits, JOB_COMPLETION_INDEX);
- volumes: the ConfigMap's files mounted read-only, one shared host directory for the PVC (group-owned by the
  pod's fsGroup, as the kubelet does), tmpfs for each emptyDir, --shm-size for the memory-backed /dev/shm;
- securityContext: the pod's uid/gid and fsGroup, read-only root filesystem, all capabilities dropped,
  no-new-privileges (Docker's default seccomp profile is RuntimeDefault); memory and CPU limits.

Pod 0 starts last, a few seconds after the others: its DNS name does not exist while they first dial it, which
is what happens on a cluster before pod 0's record is published. The first test then asserts what a user sees:
every pod exits 0 and prints FINISHED with its own rank, one world size, the configured step count and one
checksum; each pod's annotated metrics port serves its metrics; rank 0's checkpoints land on the shared volume.

The other two replace pods the way the Job controller does (a new container per attempt, same hostname and DNS
names, a new address) and count what the Job would count, from the pods' exit codes and its podFailurePolicy:
- a pod lost mid-run (its network cut, then killed): its replacement starts at once, finds the old pod 0's
  store still up and waits (app.cluster.k8s_launch) until pod 0 has timed out and been replaced; the second attempt
  resumes from the checkpoint and finishes;
- a pod evicted (SIGTERM, the grace period): it ends 143, its peer 75, and neither is counted.

    make k8s-emulate      (= make image, then .venv/bin/python -m pytest tests/e2e/test_k8s_emulation.py)

Outside CI it skips (saying why) without Docker or the image; under CI=true it fails without Docker and builds
the image with `make image` if it is missing.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import STEP_PACE_SECONDS
from tests.unit.test_k8s import ROOT, container, kustomize, quantity, render_pod
from tools.docker_cli import docker

# Bounded by DEADLINE_S once started; the rest is room for a cold `make image` under CI.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def cpu_render() -> tuple[dict, dict]:
    """(the Job, every object) as `kubectl apply -k k8s/cpu/` sends them."""
    objs = kustomize("cpu")
    return objs[("Job", "ddp-train")], objs


def image() -> str:
    """The manifest's own image (ddp-cluster:latest, what `make image` builds); DDP_IMAGE runs another build."""
    return os.environ.get("DDP_IMAGE") or container(cpu_render()[0])["image"]


NAMESPACE = "default"
POD0_DELAY_S = 4.0  # pod 0 starts this long after the others
DEADLINE_S = 180.0
FINISHED = re.compile(r"^FINISHED rank=(\d+) world_size=(\d+) step=(\d+) checksum=([0-9a-f]{16})$", re.M)


def require_docker_and_image() -> None:
    def unavailable(reason: str) -> None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: the emulation must run, not skip)")
        pytest.skip(reason)

    try:
        info = docker("info", "--format", "{{.ServerVersion}}", timeout=20, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        unavailable("no Docker client or the engine does not answer: run `make docker-setup`")
    if info.returncode != 0:
        unavailable(f"Docker engine not reachable ({info.stderr.strip()[:120]}): run `make docker-setup`")
    if docker("image", "inspect", image(), check=False).returncode != 0:
        if os.environ.get("CI") != "true":
            pytest.skip(f"image {image()} not built: run `make image` (or `make k8s-emulate`, which builds it)")
        # CI builds it for the compose tests, which run first; alone, build it here (minutes when cold).
        build = subprocess.run(["make", "image"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert build.returncode == 0, f"make image failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"


def docker_run_args(pod, objs: dict, workdir: Path, name: str, network: str) -> list[str]:
    """`docker run` flags that give the container what the kubelet would give pod ``pod``."""
    spec, c = pod.spec, pod.container
    pod_sc, sc = spec.get("securityContext", {}), {**spec.get("securityContext", {}), **c["securityContext"]}
    argv = [
        "run",
        "-d",
        "--name",
        name,
        "--network",
        network,
        "--hostname",
        pod.hostname,
        # /etc/hosts then holds "<ip> ddp-train-i.ddp-train.<ns>.svc.cluster.local ddp-train-i", like a pod's.
        "--domainname",
        pod.dns_names[-1].split(".", 1)[1],
    ]
    for alias in pod.dns_names:
        argv += ["--network-alias", alias]
    argv += ["--user", f"{sc['runAsUser']}:{sc['runAsGroup']}"]
    if "fsGroup" in pod_sc:
        argv += ["--group-add", str(pod_sc["fsGroup"])]
    if sc.get("readOnlyRootFilesystem"):
        argv.append("--read-only")
    if "ALL" in sc.get("capabilities", {}).get("drop", []):
        argv += ["--cap-drop", "ALL"]
    if sc.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    limits = c["resources"]["limits"]
    argv += ["--memory", str(int(quantity(limits["memory"]))), "--cpus", str(quantity(limits["cpu"]))]

    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in c["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            host = workdir / f"configmap-{volume['configMap']['name']}"
            host.mkdir(exist_ok=True)
            for key, text in objs[("ConfigMap", volume["configMap"]["name"])]["data"].items():
                (host / key).write_text(text)
            host.chmod(0o755)
            argv += ["-v", f"{host}:{mount['mountPath']}:ro"]
        elif "persistentVolumeClaim" in volume:
            host = workdir / f"pvc-{volume['persistentVolumeClaim']['claimName']}"  # one volume for all pods
            host.mkdir(exist_ok=True)
            if "fsGroup" in pod_sc and os.geteuid() == 0:  # the kubelet makes it group-owned, setgid, for fsGroup
                os.chown(host, 0, pod_sc["fsGroup"])
                host.chmod(0o2775)
            else:
                host.chmod(0o777)
            argv += ["-v", f"{host}:{mount['mountPath']}{':ro' if mount.get('readOnly') else ''}"]
        elif "emptyDir" in volume:
            size = volume["emptyDir"].get("sizeLimit")
            if mount["mountPath"] == "/dev/shm" and volume["emptyDir"].get("medium") == "Memory":
                argv += ["--shm-size", str(int(quantity(size or "64Mi")))]
            else:
                argv += [
                    "--tmpfs",
                    f"{mount['mountPath']}:rw,mode=1777" + (f",size={int(quantity(size))}" if size else ""),
                ]
        else:
            raise NotImplementedError(f"volume {mount['name']}: {sorted(volume)} is not emulated")
    for key, value in pod.env.items():
        argv += ["-e", f"{key}={value}"]
    command, args = c.get("command"), pod.argv[len(c.get("command", [])) :]
    if command:  # the manifest's command replaces the image's entrypoint, as in Kubernetes
        argv += ["--entrypoint", pod.argv[0], image(), *pod.argv[1 : len(command)], *args]
    else:
        argv += [image(), *args]
    return argv


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=3) as response:
        return response.read().decode()


def test_job_pod_template_trains_as_containers_named_like_the_pods(tmp_path):
    require_docker_and_image()
    job, objs = cpu_render()
    n = job["spec"]["completions"]
    pods = [render_pod(job, objs, i, NAMESPACE) for i in range(n)]
    config = yaml.safe_load(objs[("ConfigMap", "ddp-train-config")]["data"]["config.yaml"])
    metrics_port = int(job["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])

    run_id = uuid.uuid4().hex[:8]
    network, names = f"ddpk8s-{run_id}", {p.index: f"ddpk8s-{run_id}-{p.hostname}" for p in pods}
    started: list[str] = []
    docker("network", "create", network)
    try:
        for pod in sorted(pods, key=lambda p: -p.index):  # pod 0 last
            if pod.index == 0:
                time.sleep(POD0_DELAY_S)
            docker(*docker_run_args(pod, objs, tmp_path, names[pod.index], network))
            started.append(names[pod.index])

        # Wait for every pod to exit; while each lingers after training, scrape the port Prometheus is given.
        scraped: dict[int, str] = {}
        t0 = time.monotonic()
        seen_finished: dict[int, float] = {}
        deadline = t0 + DEADLINE_S
        while time.monotonic() < deadline:
            running = []
            for pod in pods:
                state = docker(
                    "inspect",
                    "-f",
                    '{{.State.Running}} {{(index .NetworkSettings.Networks "' + network + '").IPAddress}}',
                    names[pod.index],
                ).stdout.split()
                if state[0] == "true":
                    running.append(pod.index)
                    if pod.index not in scraped and "FINISHED" in docker("logs", names[pod.index]).stdout:
                        seen_finished.setdefault(pod.index, time.monotonic() - t0)
                        # not listening yet or already gone: try again on the next round
                        with contextlib.suppress(OSError):
                            scraped[pod.index] = scrape(f"http://{state[1]}:{metrics_port}/metrics")
            if not running:
                break
            time.sleep(0.5)
        logs = {p.index: docker("logs", names[p.index]) for p in pods}
        unresolved = sum(log.stderr.count("Name or service not known") for i, log in logs.items() if i)
        print(
            f"k8s emulation: {n} pods; FINISHED seen at {seen_finished} s after pod 0 started; all exited after "
            f"{time.monotonic() - t0:.1f} s (metrics linger included); pod 0's name was unresolvable "
            f"{unresolved} times for its peers before it started"
        )
        codes = {p.index: int(docker("inspect", "-f", "{{.State.ExitCode}}", names[p.index]).stdout) for p in pods}
        still_running = docker("ps", "-q", "--filter", f"network={network}").stdout.split()
        built = docker("image", "inspect", "-f", "{{.Created}}", image()).stdout.strip()
        report = f"image {image()} built {built} (older than app/? `make image`)\n" + "\n".join(
            f"--- pod {i} (exit {codes[i]}) ---\n{log.stdout[-3000:]}\n{log.stderr[-3000:]}" for i, log in logs.items()
        )
        assert not still_running, f"pods still running after {DEADLINE_S:.0f} s\n{report}"
        assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{report}"

        finished = {i: FINISHED.findall(log.stdout) for i, log in logs.items()}
        assert all(len(lines) == 1 for lines in finished.values()), f"one FINISHED line per pod\n{report}"
        lines = {i: lines[0] for i, lines in finished.items()}
        # One process per pod: rank = node rank = the pod's completion index.
        assert {i: int(line[0]) for i, line in lines.items()} == {i: i for i in range(n)}
        assert {int(line[1]) for line in lines.values()} == {n}
        assert {int(line[2]) for line in lines.values()} == {int(config["steps"])}
        assert len({line[3] for line in lines.values()}) == 1, f"ranks ended with different parameters: {lines}"

        assert sorted(scraped) == list(range(n)), (
            f"metrics port {metrics_port} never answered on pods {sorted(set(range(n)) - set(scraped))}"
        )
        for i, text in scraped.items():
            assert f'ddp_world_size{{rank="{i}"}} {float(n)}' in text
            steps = re.search(rf'^ddp_optimizer_steps_total{{rank="{i}"}} ([0-9.e+]+)$', text, re.M)
            assert steps and math.isclose(float(steps.group(1)), float(config["steps"])), text[:2000]

        mount = next(m for m in container(job)["volumeMounts"] if m["mountPath"] == pods[0].env["DDP_CHECKPOINT_DIR"])
        claim = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        pvc = tmp_path / f"pvc-{claim['persistentVolumeClaim']['claimName']}"
        saved = sorted(p.name for p in pvc.glob("step-*.pt"))
        assert saved and saved[-1] == f"step-{int(config['steps']):08d}.pt", saved
        assert len(saved) <= int(config["keep_checkpoints"]), saved
    finally:
        if started:
            docker("rm", "-f", *started, check=False)
        docker("network", "rm", network, check=False)


# ---------------------------------------------------------------------------------------------------------------
# A pod lost mid-run: what the Job counts, and the replacement never joins the old store
# ---------------------------------------------------------------------------------------------------------------
# The old pod 0 must outlive its lost peer for a while, as on a cluster where a node vanishes without a TCP reset
# (NCCL then waits for its timeout): a short collective timeout keeps that wait inside the test.
# Longer than a replacement pod takes to start and reach the store (a container start and the launcher's import of
# torch: seconds, tens of seconds at a load of 10), so the replacement is seen waiting while the old pod 0 still
# hosts it. Every second of it is waited in full: 60 s did the same and cost 15 s more.
COLLECTIVE_TIMEOUT_S = 45
KILL_AT_CHECKPOINT = "step-00000050.pt"
# More steps than the kill's checkpoint, so that training still runs when pod 1 goes (the test polls every 0.5 s;
# steps paced to STEP_PACE_SECONDS at least: the 250 steps after it take 5 s or more); each step past that is only a
# cost, paid again by the second attempt, which trains from the checkpoint to the end.
LOST_POD_STEPS = "300"
# Two attempts of two pods, each starting Python and torch under whatever else the machine runs.
LOST_POD_DEADLINE_S = 420.0


class EmulatedJob:
    """The Job's pods as containers on one Docker network, each index replaced the way the Job controller does:
    a new container (new name, same hostname and DNS names) once the previous one of that index has ended."""

    def __init__(self, tmp_path: Path, env: dict[str, str]):
        self.job, self.objs = cpu_render()
        self.tmp, self.env = tmp_path, env
        run_id = uuid.uuid4().hex[:8]
        self.network, self.prefix = f"ddpk8s-{run_id}", f"ddpk8s-{run_id}"
        self.pods: dict[int, list[str]] = {}  # index -> container names, one per attempt
        # An address per attempt, as a cluster gives a new pod: Docker would hand the lost pod's address to its
        # replacement, whose kernel then resets the old peers' connections, which no cluster does.
        for _ in range(8):
            self.subnet = f"10.{random.randint(64, 127)}.{random.randint(0, 255)}"
            made = docker("network", "create", "--subnet", f"{self.subnet}.0/24", self.network, check=False)
            if made.returncode == 0:
                break
        else:
            raise AssertionError(f"no free subnet for the emulated pods: {made.stderr}")

    def start(self, index: int) -> str:
        pod = render_pod(self.job, self.objs, index, NAMESPACE)
        pod.env.update(self.env)
        attempts = self.pods.setdefault(index, [])
        name = f"{self.prefix}-{pod.hostname}-{len(attempts)}"
        argv = docker_run_args(pod, self.objs, self.tmp, name, self.network)
        address = f"{self.subnet}.{10 + 10 * len(attempts) + index}"
        docker(*argv[:2], "--ip", address, *argv[2:])
        attempts.append(name)
        return name

    def exit_code(self, name: str) -> int | None:
        running, code = docker("inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", name).stdout.split()
        return None if running == "true" else int(code)

    def wait_exit(self, name: str, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while (code := self.exit_code(name)) is None:
            assert time.monotonic() < deadline, f"{name} still running after {timeout_s:.0f} s\n{self.report()}"
            time.sleep(0.5)
        return code

    def logs(self, name: str) -> str:
        out = docker("logs", name)
        return out.stdout + out.stderr

    def report(self) -> str:
        return "\n".join(
            f"--- {name} (exit {self.exit_code(name)}) ---\n{self.logs(name)[-2500:]}"
            for names in self.pods.values()
            for name in names
        )

    def close(self) -> None:
        names = [n for names in self.pods.values() for n in names]
        if names:
            docker("rm", "-f", *names, check=False)
        docker("network", "rm", self.network, check=False)


def charged(job: dict, exit_code: int, disrupted: bool = False) -> bool:
    """Whether the Job counts this failed pod against backoffLimit, read from its podFailurePolicy."""
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        if disrupted and "onPodConditions" in rule:
            return rule["action"] == "Count"
        if exit_code in rule.get("onExitCodes", {}).get("values", []):
            return rule["action"] == "Count"
    return True


def test_a_lost_pod_is_replaced_and_its_replacement_waits_for_a_new_store(tmp_path):
    require_docker_and_image()
    # More steps than the ConfigMap's, so that training still runs when pod 1 is lost; no metrics linger.
    env = {
        "DDP_COLLECTIVE_TIMEOUT_SECONDS": str(COLLECTIVE_TIMEOUT_S),
        "DDP_STEPS": LOST_POD_STEPS,
        "DDP_MIN_STEP_SECONDS": STEP_PACE_SECONDS,
    }
    emu = EmulatedJob(tmp_path, {**env, "DDP_METRICS_LINGER_SECONDS": "0"})
    try:
        t0 = time.monotonic()
        old1 = emu.start(1)
        time.sleep(POD0_DELAY_S)
        old0 = emu.start(0)
        pvc = tmp_path / "pvc-ddp-train-checkpoints"
        deadline = time.monotonic() + LOST_POD_DEADLINE_S
        while not (pvc / KILL_AT_CHECKPOINT).exists():
            late = f"no {KILL_AT_CHECKPOINT} in {LOST_POD_DEADLINE_S:.0f} s"
            assert time.monotonic() < deadline, f"{late}\n{emu.report()}"
            assert emu.exit_code(old0) is None and emu.exit_code(old1) is None, emu.report()
            time.sleep(0.5)

        # Node 1 is lost: its network first, so no connection reset reaches pod 0, then the pod itself.
        t_kill = time.monotonic() - t0
        docker("network", "disconnect", "-f", emu.network, old1)
        docker("kill", old1)
        assert emu.wait_exit(old1, 30) == 137
        # The Job controller: index 1 has ended, so its replacement starts now, while pod 0 still waits on node 1.
        new1 = emu.start(1)
        old0_code = emu.wait_exit(old0, COLLECTIVE_TIMEOUT_S + 120)
        held_back = "previous attempt's" in emu.logs(new1)
        assert emu.exit_code(new1) is None, f"the replacement of pod 1 gave up waiting\n{emu.report()}"
        t_old0 = time.monotonic() - t0
        new0 = emu.start(0)  # index 0 has ended: its replacement hosts a new store
        codes = {name: emu.wait_exit(name, LOST_POD_DEADLINE_S) for name in (new0, new1)}
        t_end = time.monotonic() - t0

        report = emu.report()
        assert held_back, f"the replacement of pod 1 did not notice the old pod 0's store\n{report}"
        assert codes == {new0: 0, new1: 0}, f"the second attempt did not finish\n{report}"
        finished = {name: FINISHED.findall(emu.logs(name)) for name in (new0, new1)}
        lines = [found[0] for found in finished.values() if len(found) == 1]
        assert len(lines) == 2 and {int(line[2]) for line in lines} == {int(env["DDP_STEPS"])}, report
        assert len({line[3] for line in lines}) == 1, f"ranks ended with different parameters: {lines}"
        resumed = re.search(r"resumed from \S+ \(step (\d+)", emu.logs(new0))
        assert resumed and int(resumed[1]) >= 50, f"the second attempt did not resume from a checkpoint\n{report}"

        # What the Job counts: the lost pod (137, as an OOM kill; a node that is gone gets DisruptionTarget on a
        # cluster and is not counted) and pod 0, whose collective timed out (a timeout is its own failure: were
        # it ignored, a group that hangs by itself would be retried until activeDeadlineSeconds).
        failures = {old1: 137, old0: old0_code}
        counted = [name for name, code in failures.items() if charged(emu.job, code)]
        print(
            f"k8s emulation, a lost pod: old pod 0 exit {old0_code}; the replacement of pod 1 waited for a new "
            f"store: {held_back}; resumed at step {resumed[1]}; failures counted {len(counted)} of "
            f"backoffLimit {emu.job['spec']['backoffLimit']}; killed at {t_kill:.0f} s, old pod 0 ended at "
            f"{t_old0:.0f} s, the second attempt finished at {t_end:.0f} s"
        )
        assert old0_code == 1, f"pod 0 should fail by its collective timeout\n{report}"
        assert counted == [old1, old0] and len(counted) < emu.job["spec"]["backoffLimit"], failures
    finally:
        emu.close()


def test_an_evicted_pod_and_its_peers_spend_no_retry(tmp_path):
    require_docker_and_image()
    # still training when pod 1 is evicted
    env = {"DDP_STEPS": LOST_POD_STEPS, "DDP_MIN_STEP_SECONDS": STEP_PACE_SECONDS, "DDP_METRICS_LINGER_SECONDS": "0"}
    emu = EmulatedJob(tmp_path, env)
    try:
        old1 = emu.start(1)
        time.sleep(POD0_DELAY_S)
        old0 = emu.start(0)
        pvc = tmp_path / "pvc-ddp-train-checkpoints"
        deadline = time.monotonic() + LOST_POD_DEADLINE_S
        while not (pvc / KILL_AT_CHECKPOINT).exists():
            late = f"no {KILL_AT_CHECKPOINT} in {LOST_POD_DEADLINE_S:.0f} s"
            assert time.monotonic() < deadline, f"{late}\n{emu.report()}"
            time.sleep(0.5)
        # An eviction: the kubelet sends SIGTERM and waits terminationGracePeriodSeconds, then the pod gets
        # DisruptionTarget. Its peers are not signalled.
        grace = emu.job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        docker("stop", "-t", str(grace), old1, timeout=grace + 30)
        codes = {old1: emu.wait_exit(old1, 30), old0: emu.wait_exit(old0, 120)}
        stopped = re.search(r"stopped at step (\d+)", emu.logs(old0))
        new1, new0 = emu.start(1), emu.start(0)  # both indexes ended: the Job replaces both
        finals = {name: emu.wait_exit(name, LOST_POD_DEADLINE_S) for name in (new0, new1)}

        report = emu.report()
        assert codes == {old1: 143, old0: 75}, f"the evicted pod ends 143, its peer 75\n{report}"
        counted = [n for n, code in codes.items() if charged(emu.job, code, disrupted=n == old1)]
        assert counted == [], f"an eviction spent the retry budget: {counted}"
        assert counted == [n for n, code in codes.items() if charged(emu.job, code)], "143 alone is ignored too"
        assert finals == {new0: 0, new1: 0}, f"the second attempt did not finish\n{report}"
        resumed = re.search(r"resumed from \S+ \(step (\d+)", emu.logs(new0))
        assert stopped and resumed and resumed[1] == stopped[1], f"not resumed where it stopped\n{report}"
        print(
            f"k8s emulation, an eviction: exit codes {sorted(codes.values())}, counted {len(counted)}; "
            f"stopped and resumed at step {stopped[1]}"
        )
    finally:
        emu.close()
