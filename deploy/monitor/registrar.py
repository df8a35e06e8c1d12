#!/usr/bin/env python3
"""vgpu-registrar: writes vgpu-monitor's container files for the GPU containers HAMi placed on this node.

HAMi writes nothing vgpu-monitor can read (docs/deploy.md, "Who writes the container files"). This program does, from
what the API server and the node know, never from anything a container can write:

- which containers hold HAMi vGPUs, their devices and limits: the pod annotation hami.io/vgpu-devices-allocated,
  written by HAMi's scheduler (Project-HAMi/HAMi pkg/device/nvidia/device.go; format in pkg/device/devices.go:
  "UUID,NVIDIA,<MiB>,<cores>:" per device, ";" after each container, init containers first);
- where each container's processes are: its containerID (pod status) found in the node's cgroup tree.

Every pass (--interval-s) it lists the pods of its node, writes <containers>/<pod UID>_<container>.conf for each
running HAMi container (atomically, only when the text changed), removes the files it wrote for containers that are
gone, and removes the verdict folders of pods that are no longer on the node. Files it did not write (no first line
"# vgpu-registrar") are never touched. If the API cannot be reached, nothing is removed.

Standard library only: it runs in the vgpu-monitor image beside the monitor (deploy/monitor/daemonset.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import ssl
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ALLOCATED_ANNOTATION = "hami.io/vgpu-devices-allocated"
MARKER = "# vgpu-registrar"
# vgpu-monitor's container names: 1 to 64 of A-Z a-z 0-9 . _ -, not starting with '.' (vgpu-core/monitor/monitor.cc).
CONTAINER_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")
POD_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
CONTAINER_ID = re.compile(r"^[0-9a-f]{64}$")
GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
CGROUP_WALK_DEPTH_MAX = 10


def log(message: str) -> None:
    print(f"vgpu-registrar: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Device:
    uuid: str
    memory_mib: int
    cores: int


@dataclass(frozen=True)
class Wanted:
    """One container file to write: the container's name for vgpu-monitor, and what goes in it."""

    name: str
    namespace: str
    pod_name: str
    container: str
    container_id: str  # "" while the container has not started
    devices: tuple[Device, ...]


def parse_allocation(text: str) -> list[list[Device]]:
    """HAMi's allocation annotation: one list of devices per container (init containers first), possibly empty.

    Raises ValueError naming the part that does not parse."""
    containers: list[list[Device]] = []
    for part in text.split(";"):
        devices: list[Device] = []
        for entry in part.split(":"):
            if "," not in entry:
                continue  # the empty tail after each ':'
            fields = entry.split(",")
            if len(fields) < 4:
                raise ValueError(f"'{entry}' has {len(fields)} fields; HAMi writes UUID,TYPE,MEMORY_MIB,CORES")
            try:
                devices.append(Device(fields[0], int(fields[2]), int(fields[3])))
            except ValueError:
                raise ValueError(f"'{entry}': memory and cores must be whole numbers, e.g. GPU-...,NVIDIA,3000,30") \
                    from None
        containers.append(devices)
    # HAMi's encoder ends every container with ';': the last split part is that terminator, not a container.
    if containers and not containers[-1] and text.endswith(";"):
        containers.pop()
    return containers


def container_id(status: dict) -> str:
    """The 64-hex id from a containerStatuses entry ("containerd://<id>", "cri-o://<id>", "docker://<id>")."""
    raw = status.get("containerID") or ""
    _, _, tail = raw.partition("://")
    return tail if CONTAINER_ID.match(tail) else ""


def wanted_files(pods: list[dict], reported: set[str]) -> tuple[list[Wanted], set[str]]:
    """The container files HAMi's pods on this node call for, and the UIDs of every pod listed.

    A container that cannot be described (a name too long for vgpu-monitor, a MIG device, a broken annotation) is
    logged once per reason (kept in `reported`) and skipped: vgpu-monitor does not judge it; its shim still limits it."""
    wanted: list[Wanted] = []
    uids: set[str] = set()
    for pod in pods:
        meta = pod.get("metadata", {})
        uid = meta.get("uid", "")
        if POD_UID.match(uid):
            uids.add(uid)
        annotation = (meta.get("annotations") or {}).get(ALLOCATED_ANNOTATION)
        phase = pod.get("status", {}).get("phase", "")
        if not annotation or phase in ("Succeeded", "Failed") or not POD_UID.match(uid):
            continue
        namespace, pod_name = meta.get("namespace", ""), meta.get("name", "")
        where = f"{namespace}/{pod_name}"
        try:
            allocation = parse_allocation(annotation)
        except ValueError as error:
            note_once(reported, f"{where}: {ALLOCATED_ANNOTATION} does not parse: {error}; not registered")
            continue
        spec = pod.get("spec", {})
        containers = list(spec.get("initContainers") or []) + list(spec.get("containers") or [])
        statuses = {s.get("name"): s for s in (pod.get("status", {}).get("initContainerStatuses") or [])
                    + (pod.get("status", {}).get("containerStatuses") or [])}
        for index, devices in enumerate(allocation):
            if not devices:
                continue
            if index >= len(containers):
                note_once(reported, f"{where}: {ALLOCATED_ANNOTATION} names container #{index}, the pod has "
                                    f"{len(containers)}; not registered")
                continue
            container = containers[index].get("name", "")
            name = f"{uid}_{container}"
            if not CONTAINER_NAME.match(name):
                note_once(reported, f"{where} container {container}: '{name}' is longer than vgpu-monitor's 64 "
                                    f"characters (container names of at most 27 fit); not registered")
                continue
            bad = [d.uuid for d in devices if not GPU_UUID.match(d.uuid)]
            if bad:
                note_once(reported, f"{where} container {container}: {','.join(bad)} is not a whole-GPU UUID "
                                    f"(MIG is not judged by vgpu-monitor); not registered")
                continue
            wanted.append(Wanted(name, namespace, pod_name, container, container_id(statuses.get(container, {})),
                                 tuple(devices)))
    return wanted, uids


def note_once(reported: set[str], message: str) -> None:
    if message not in reported:
        reported.add(message)
        log(message)


def cgroup_hierarchy(cgroup_root: Path) -> Path:
    """Where the paths vgpu-monitor reads from /proc/<pid>/cgroup are rooted: the unified tree (cgroup v2), else the
    memory controller's (v1), the line vgpu-monitor takes there (vgpu-core/monitor/monitor.cc, CgroupPath)."""
    if (cgroup_root / "cgroup.controllers").exists():
        return cgroup_root
    return cgroup_root / "memory"


def find_container_cgroups(hierarchy: Path) -> dict[str, str]:
    """Container id -> cgroup path as /proc/<pid>/cgroup shows it in the host's cgroup namespace.

    Matches the id inside a folder's name, which covers the systemd driver (cri-containerd-<id>.scope,
    crio-<id>.scope, docker-<id>.scope) and the cgroupfs driver (<id>); CRI-O's conmon-<id> folders are skipped."""
    found: dict[str, str] = {}
    base_depth = len(hierarchy.parts)
    for folder, subfolders, _ in os.walk(hierarchy):
        depth = len(Path(folder).parts) - base_depth
        if depth >= CGROUP_WALK_DEPTH_MAX:
            subfolders[:] = []
        for sub in subfolders:
            if "conmon" in sub:
                continue
            match = re.search(r"(?<![0-9a-f])([0-9a-f]{64})(?![0-9a-f])", sub)
            if match:
                relative = (Path(folder) / sub).relative_to(hierarchy)
                found.setdefault(match.group(1), "/" + relative.as_posix())
    return found


def conf_text(want: Wanted, cgroup: str, hami_containers: Path) -> str:
    """The container file: what vgpu-monitor reads (docs/node-monitor.md), with the limits HAMi's device plugin
    gives the container (CUDA_DEVICE_MEMORY_LIMIT_<i>=<MiB>m in allocation order, one CUDA_DEVICE_SM_LIMIT: the
    first device's cores; pkg/device-plugin/nvidiadevice/nvinternal/plugin/server.go, Allocate), its names for the
    monitor's metrics, and VGPU_CACHE: the host folder HAMi's plugin makes for the container's cache file
    (<gpuHookPath>/vgpu/containers/<pod UID>_<container>, server.go), read with --hami-metrics (docs/metrics.md)."""
    lines = [
        f"{MARKER}: {want.namespace}/{want.pod_name} container {want.container}, from {ALLOCATED_ANNOTATION}",
        f"VGPU_CGROUP={cgroup}",
        "VGPU_DEVICES=" + ",".join(d.uuid for d in want.devices),
        f"VGPU_POD_NAMESPACE={want.namespace}",
        f"VGPU_POD_NAME={want.pod_name}",
        f"VGPU_CONTAINER_NAME={want.container}",
        f"VGPU_CACHE={hami_containers / want.name}",
    ]
    lines += [f"CUDA_DEVICE_MEMORY_LIMIT_{i}={d.memory_mib}m" for i, d in enumerate(want.devices)]
    if want.devices[0].cores > 0:
        lines.append(f"CUDA_DEVICE_SM_LIMIT={want.devices[0].cores}")
    return "\n".join(lines) + "\n"


def write_if_changed(path: Path, text: str) -> bool:
    """Writes `text` to `path` through a hidden temporary file renamed over it (vgpu-monitor ignores names starting
    with '.'); True when the file changed."""
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
    return True


def written_by_us(path: Path) -> bool:
    try:
        with open(path) as handle:
            return handle.readline().startswith(MARKER)
    except OSError:
        return False


def sync(pods: list[dict], containers_dir: Path, verdicts_dir: Path, hierarchy: Path, reported: set[str],
         hami_containers: Path = Path("/usr/local/vgpu/containers")) -> None:
    """One pass: container files written for `pods`, stale ones and stale verdict folders removed."""
    wanted, uids = wanted_files(pods, reported)
    cgroups = find_container_cgroups(hierarchy) if any(w.container_id for w in wanted) else {}
    kept: set[str] = set()
    for want in wanted:
        path = containers_dir / f"{want.name}.conf"
        cgroup = cgroups.get(want.container_id) if want.container_id else None
        if cgroup is None:
            # Not started yet, or its cgroup not found: an existing file is kept (a restart gets a new id).
            if path.exists():
                kept.add(path.name)
            continue
        kept.add(path.name)
        if write_if_changed(path, conf_text(want, cgroup, hami_containers)):
            log(f"wrote {path} ({want.namespace}/{want.pod_name} container {want.container}, cgroup {cgroup})")
    for path in containers_dir.glob("*.conf"):
        if path.name not in kept and written_by_us(path):
            path.unlink(missing_ok=True)
            log(f"removed {path} (its container is gone)")
    if verdicts_dir.is_dir():
        for folder in verdicts_dir.iterdir():
            uid, sep, _ = folder.name.partition("_")
            if sep and POD_UID.match(uid) and uid not in uids and folder.is_dir() and \
                    not (containers_dir / f"{folder.name}.conf").exists():
                for leftover in folder.iterdir():
                    leftover.unlink(missing_ok=True)
                folder.rmdir()
                log(f"removed {folder} (its pod is gone)")


class ApiServer:
    """GET on the API server with the pod's service account token, re-read at each call (the kubelet rotates it)."""

    def __init__(self, url: str, credentials: Path, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.credentials = credentials
        self.timeout_s = timeout_s
        self.context = ssl.create_default_context(cafile=str(credentials / "ca.crt"))

    def pods_on(self, node: str) -> list[dict]:
        query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}", "resourceVersion": "0"})
        request = urllib.request.Request(f"{self.url}/api/v1/pods?{query}")
        request.add_header("Authorization", "Bearer " + (self.credentials / "token").read_text().strip())
        request.add_header("Accept", "application/json")
        with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.context) as response:
            return json.load(response).get("items", [])


def default_api_url() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", default=os.environ.get("NODE_NAME", ""), help="this node's name (NODE_NAME)")
    parser.add_argument("--containers", type=Path, default=Path("/etc/vgpu/containers"),
                        help="vgpu-monitor's --containers folder")
    parser.add_argument("--verdicts", type=Path, default=Path("/run/vgpu/verdicts"),
                        help="vgpu-monitor's --verdicts folder (stale pods' folders are removed)")
    parser.add_argument("--hami-containers", type=Path, default=Path("/usr/local/vgpu/containers"),
                        help="the host folder of HAMi's per-container folders (<global.gpuHookPath>/vgpu/containers)")
    parser.add_argument("--cgroup-root", type=Path, default=Path("/host/sys/fs/cgroup"),
                        help="the host's /sys/fs/cgroup, mounted read-only")
    parser.add_argument("--interval-s", type=float, default=10.0, help="seconds between passes (1 to 3600)")
    parser.add_argument("--api", default=default_api_url(), help="the API server's URL (in-cluster default)")
    parser.add_argument("--credentials", type=Path, default=Path("/var/run/secrets/kubernetes.io/serviceaccount"),
                        help="folder holding the service account's token and ca.crt")
    parser.add_argument("--pods-json", type=Path,
                        help="read a PodList from this file instead of the API server (one pass; for testing)")
    parser.add_argument("--once", action="store_true", help="one pass, then exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    if not 1 <= options.interval_s <= 3600:
        parser.error(f"--interval-s {options.interval_s} is not from 1 to 3600; e.g. 10")
    if options.pods_json is None and (not options.node or not options.api):
        parser.error("--node (or NODE_NAME) and --api (or KUBERNETES_SERVICE_HOST) are needed without --pods-json")
    hierarchy = cgroup_hierarchy(options.cgroup_root)
    reported: set[str] = set()
    if options.pods_json is not None:
        sync(json.loads(options.pods_json.read_text()).get("items", []), options.containers, options.verdicts,
             hierarchy, reported, options.hami_containers)
        return 0
    try:
        api = ApiServer(options.api, options.credentials, timeout_s=min(30.0, options.interval_s * 3))
    except OSError as error:
        log(f"cannot read the API server's CA certificate in {options.credentials}: {error}")
        return 2
    log(f"node {options.node}: writing {options.containers}, every {options.interval_s:g} s")
    api_failing = False
    while True:
        pods = None
        try:
            pods = api.pods_on(options.node)
            if api_failing:
                log("the API server answers again")
            api_failing = False
        except (OSError, ValueError) as error:  # urllib's errors are OSErrors; a bad JSON body a ValueError
            if not api_failing:
                log(f"cannot list this node's pods ({error}); container files kept as they are, retrying")
            api_failing = True
        if pods is not None:
            try:
                sync(pods, options.containers, options.verdicts, hierarchy, reported, options.hami_containers)
            except OSError as error:
                note_once(reported, f"cannot write the container files: {error}; retrying")
        if options.once:
            return 0 if not api_failing else 1
        time.sleep(options.interval_s)


if __name__ == "__main__":
    sys.exit(main())
