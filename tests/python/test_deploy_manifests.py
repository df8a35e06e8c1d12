"""deploy/, checked offline: every manifest against Kubernetes' schemas (strict), the chart values against the keys
HAMi's chart has, and the cross-references that can break (flags, mounts, ports, accounts, what the Dockerfiles copy,
the container files vgpu-registrar writes). docs/deploy.md says what this does not show (nothing here ran on a
cluster)."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
MONITOR_MAIN = REPO_ROOT / "vgpu-core" / "monitor" / "monitor_main.cc"
SHIM_CONFIG_HEADER = REPO_ROOT / "vgpu-core" / "policy" / "include" / "vgpu" / "policy" / "config.h"
DOCKERFILES = [DEPLOY / "hami" / "Dockerfile.withlib", DEPLOY / "monitor" / "Dockerfile"]
# The oldest Kubernetes still common in GPU clusters, and the newest whose schemas kubernetes-validate 1.37.0 carries.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# The value keys of HAMi's chart that deploy/hami/values-vgpu.yaml may set: Project-HAMi/HAMi at 4707fb0,
# charts/hami/values.yaml (chart 2.10.0); how each is used: templates/_helpers.tpl, "hami.devicePlugin.image".
HAMI_CHART_KEYS = {
    "global.imageRegistry", "global.imageTag", "global.gpuHookPath",
    "devicePlugin.image.registry", "devicePlugin.image.repository", "devicePlugin.image.tag",
    "devicePlugin.image.pullPolicy", "devicePlugin.image.pullSecrets",
    "devicePlugin.monitor.image.registry", "devicePlugin.monitor.image.repository", "devicePlugin.monitor.image.tag",
    "devicePlugin.libPath", "devicePlugin.nvidiaNodeSelector", "devicePlugin.runtimeClassName",
}


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def manifests() -> list[tuple[str, dict]]:
    """(file:index, document) for every Kubernetes object under deploy/."""
    found = []
    for path in yaml_files():
        for index, document in enumerate(yaml.safe_load_all(path.read_text())):
            if isinstance(document, dict) and "apiVersion" in document and "kind" in document:
                found.append((f"{path.relative_to(REPO_ROOT)}:{index}", document))
    return found


def the(kind: str, name: str) -> dict:
    matches = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"deploy/ has {len(matches)} {kind} named {name}, expected one"
    return matches[0]


def pod_container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def option_values(args: list[str]) -> dict[str, str]:
    """--flag value pairs (every vgpu-monitor option but --help and --cgroup-of takes one value)."""
    assert len(args) % 2 == 0, f"args {args} are not --flag value pairs"
    return {args[i]: args[i + 1] for i in range(0, len(args), 2)}


def mounts(container: dict, pod_spec: dict) -> dict[str, tuple[str | None, bool]]:
    """mountPath -> (the hostPath behind it, read-only)."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    return {m["mountPath"]: (volumes[m["name"]].get("hostPath", {}).get("path"), bool(m.get("readOnly")))
            for m in container["volumeMounts"]}


# ---------------------------------------------------------------------------------------------- parsing and schemas


def test_every_yaml_file_under_deploy_parses_and_the_expected_objects_are_there():
    assert yaml_files(), "no YAML under deploy/"
    for path in yaml_files():
        documents = list(yaml.safe_load_all(path.read_text()))
        assert documents and all(d is not None for d in documents), f"{path}: an empty document"
    kinds = sorted((d["kind"], d["metadata"]["name"]) for _, d in manifests())
    assert ("DaemonSet", "vgpu-monitor") in kinds and ("ServiceAccount", "vgpu-registrar") in kinds, kinds
    assert ("Pod", "trainer-example") in kinds, kinds


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("where,document", manifests(), ids=[w for w, _ in manifests()])
def test_every_manifest_passes_strict_schema_validation(where, document, version):
    kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize("breakage", ["misspelled field", "wrong type"])
def test_strict_validation_rejects_a_broken_daemonset(breakage):
    broken = copy.deepcopy(the("DaemonSet", "vgpu-monitor"))
    spec = broken["spec"]["template"]["spec"]
    if breakage == "misspelled field":
        spec["hostPid"] = spec.pop("hostPID")
    else:
        pod_container(spec, "vgpu-monitor")["ports"][0]["containerPort"] = "9395"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


# ---------------------------------------------------------------------------------------------- HAMi's chart values


def key_paths(tree: dict, prefix: str = "") -> set[str]:
    """Dotted paths to the leaves of a values tree (a map under a key HAMi treats as a map counts as a leaf)."""
    paths = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in HAMI_CHART_KEYS:
            paths |= key_paths(value, path + ".")
        else:
            paths.add(path)
    return paths


def unknown_chart_keys(values: dict) -> set[str]:
    return key_paths(values) - HAMI_CHART_KEYS


def test_the_chart_values_name_only_keys_of_hamis_chart_and_replace_the_device_plugin_image():
    values = yaml.safe_load((DEPLOY / "hami" / "values-vgpu.yaml").read_text())
    assert unknown_chart_keys(values) == set()
    image = values["devicePlugin"]["image"]
    assert image["registry"] and image["repository"] and image["tag"], image
    # The tag must be the HAMi release the image is built on, or HAMi's scheduler and monitor would differ from it.
    base = re.search(r"^ARG HAMI_IMAGE=\S+:(\S+)$", (DEPLOY / "hami" / "Dockerfile.withlib").read_text(), re.M)
    assert base and values["global"]["imageTag"] == base.group(1) and image["tag"].startswith(base.group(1))


def test_a_values_key_hamis_chart_does_not_have_is_caught():
    values = yaml.safe_load((DEPLOY / "hami" / "values-vgpu.yaml").read_text())
    values["devicePlugin"]["image"]["name"] = "hami-vgpu"  # the chart reads repository, not name
    assert unknown_chart_keys(values) == {"devicePlugin.image.name"}


# ---------------------------------------------------------------------------------------------- cross-references


def accepted_monitor_options() -> set[str]:
    """The options vgpu-monitor's ParseOptions compares against (its source, so a build is not needed)."""
    options = set(re.findall(r'name == "(--[a-z-]+)"', MONITOR_MAIN.read_text()))
    assert {"--containers", "--verdicts"} <= options, f"could not read the options from {MONITOR_MAIN}"
    return options


def bad_monitor_args(args: list[str]) -> list[str]:
    accepted = accepted_monitor_options()
    problems = [f"{flag}: vgpu-monitor has no such option" for flag in option_values(args) if flag not in accepted]
    values = option_values(args)
    if not 10 <= int(values.get("--period-ms", "100")) <= 60000:
        problems.append("--period-ms out of 10..60000")
    if values.get("--action", "report") not in ("report", "kill"):
        problems.append("--action is not report or kill")
    return problems


def test_the_monitor_is_given_only_options_it_accepts():
    spec = the("DaemonSet", "vgpu-monitor")["spec"]["template"]["spec"]
    assert bad_monitor_args(pod_container(spec, "vgpu-monitor")["args"]) == []


def test_an_option_the_monitor_does_not_have_is_caught():
    spec = the("DaemonSet", "vgpu-monitor")["spec"]["template"]["spec"]
    args = list(pod_container(spec, "vgpu-monitor")["args"])
    args[args.index("--period-ms")] = "--period"
    assert bad_monitor_args(args) == ["--period: vgpu-monitor has no such option"]


def test_the_registrar_is_given_only_options_it_accepts(registrar):
    spec = the("DaemonSet", "vgpu-monitor")["spec"]["template"]["spec"]
    options = registrar.build_parser().parse_args(pod_container(spec, "vgpu-registrar")["args"])
    assert 1 <= options.interval_s <= 3600


def test_the_service_account_and_its_role_exist_and_only_the_registrar_gets_a_token():
    daemonset = the("DaemonSet", "vgpu-monitor")
    spec = daemonset["spec"]["template"]["spec"]
    namespace = daemonset["metadata"]["namespace"]
    account = the("ServiceAccount", spec["serviceAccountName"])
    assert account["metadata"]["namespace"] == namespace
    the("Namespace", namespace)
    binding = the("ClusterRoleBinding", "vgpu-registrar")
    the(binding["roleRef"]["kind"], binding["roleRef"]["name"])
    assert {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": namespace} in binding["subjects"]
    role = the("ClusterRole", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}], "RBAC grew"
    # vgpu-monitor calls no API: no token in its container, the registrar's projected into the registrar only.
    assert spec["automountServiceAccountToken"] is False
    token_mounts = {c["name"] for c in spec["containers"] for m in c["volumeMounts"] if m["name"] == "registrar-token"}
    assert token_mounts == {"vgpu-registrar"}


def test_a_daemonset_naming_a_missing_service_account_is_caught():
    accounts = {d["metadata"]["name"] for _, d in manifests() if d["kind"] == "ServiceAccount"}
    broken = copy.deepcopy(the("DaemonSet", "vgpu-monitor"))
    broken["spec"]["template"]["spec"]["serviceAccountName"] = "vgpu-monitor"
    assert broken["spec"]["template"]["spec"]["serviceAccountName"] not in accounts


def test_the_folders_in_the_args_are_the_mounted_host_folders():
    spec = the("DaemonSet", "vgpu-monitor")["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    monitor = pod_container(spec, "vgpu-monitor")
    values = option_values(monitor["args"])
    monitor_mounts = mounts(monitor, spec)
    # Same path on the host and in the container, so docs/node-monitor.md's paths hold on the node as written.
    assert monitor_mounts[values["--containers"]] == (values["--containers"], True), "containers: read-only"
    assert monitor_mounts[values["--verdicts"]] == (values["--verdicts"], False), "verdicts: read-write"
    registrar = pod_container(spec, "vgpu-registrar")
    registrar_values = option_values(registrar["args"])
    registrar_mounts = mounts(registrar, spec)
    assert registrar_values["--containers"] == values["--containers"]
    assert registrar_values["--verdicts"] == values["--verdicts"]
    assert registrar_mounts[values["--containers"]] == (values["--containers"], False)
    assert registrar_mounts[registrar_values["--cgroup-root"]] == ("/sys/fs/cgroup", True)
    # VGPU_CACHE names host paths under --hami-containers: the monitor must see them at the same path.
    hami = registrar_values["--hami-containers"]
    assert monitor_mounts[hami] == (hami, True)


def test_the_example_pod_mounts_its_own_verdict_folder_read_only_where_the_shim_reads_it():
    monitor_spec = the("DaemonSet", "vgpu-monitor")["spec"]["template"]["spec"]
    verdicts = option_values(pod_container(monitor_spec, "vgpu-monitor")["args"])["--verdicts"]
    default_file = re.search(r'kDefaultVerdictFile = "([^"]+)"', SHIM_CONFIG_HEADER.read_text()).group(1)
    pod = the("Pod", "trainer-example")["spec"]
    container = pod["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(Path(default_file).parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == verdicts and mount["readOnly"] is True
    # <pod UID>_<container>: the name vgpu-registrar gives the container's file, hence its verdict folder.
    assert mount["subPathExpr"] == f"$(POD_UID)_{container['name']}"
    uid = next(e for e in container["env"] if e["name"] == "POD_UID")
    assert uid["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"


def test_the_metrics_port_is_the_one_the_monitor_serves_and_the_service_and_annotations_name():
    daemonset = the("DaemonSet", "vgpu-monitor")
    spec = daemonset["spec"]["template"]["spec"]
    monitor = pod_container(spec, "vgpu-monitor")
    port = int(option_values(monitor["args"])["--metrics-port"])
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in monitor["ports"]
    assert daemonset["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    service = the("Service", "vgpu-monitor")
    assert service["spec"]["selector"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "metrics")]


# ---------------------------------------------------------------------------------------------- Dockerfiles


def build_outputs() -> dict[str, str]:
    """Artifacts of the default preset, where CMake puts them: {path under the source tree: target}."""
    presets = json.loads((REPO_ROOT / "CMakePresets.json").read_text())
    binary_dir = next(p["binaryDir"] for p in presets["configurePresets"] if p["name"] == "default")
    binary_dir = binary_dir.replace("${sourceDir}/", "")
    top = (REPO_ROOT / "CMakeLists.txt").read_text()
    assert "CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/lib" in top
    assert "CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin" in top
    outputs = {}
    if re.search(r"^vgpu_shim\(vgpu 0\)", (REPO_ROOT / "vgpu-core/hooks/CMakeLists.txt").read_text(), re.M):
        outputs[f"{binary_dir}/lib/libvgpu.so"] = "vgpu"
    if "add_executable(vgpu-monitor " in (REPO_ROOT / "vgpu-core/monitor/CMakeLists.txt").read_text():
        outputs[f"{binary_dir}/bin/vgpu-monitor"] = "vgpu-monitor"
    return outputs


def copy_problems(dockerfile_text: str) -> list[str]:
    """What a Dockerfile copies that neither the repository (the build context is its root) nor the build makes."""
    problems = []
    outputs = build_outputs()
    workdir = "/"
    built_targets = set()
    for line in re.sub(r"\\\n", " ", dockerfile_text).splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "WORKDIR":
            workdir = words[1].rstrip("/") + "/"
        if words[0] == "RUN" and "--target" in words:
            built_targets |= set(words[words.index("--target") + 1:words.index("--target") + 3]) - {"&&"}
        if words[0] != "COPY":
            continue
        flags = [w for w in words[1:] if w.startswith("--")]
        sources = [w for w in words[1:] if not w.startswith("--")][:-1]
        for source in sources:
            if any(f.startswith("--from=") for f in flags):
                relative = source.removeprefix(workdir)
                target = outputs.get(relative)
                if target is None:
                    problems.append(f"COPY --from {source}: not an artifact of the default preset")
                elif target not in built_targets:
                    problems.append(f"COPY --from {source}: target {target} is not built (--target)")
            elif not (REPO_ROOT / source).exists():
                problems.append(f"COPY {source}: not in the repository")
    return problems


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_the_dockerfiles_copy_only_what_the_repository_holds_or_the_build_makes(dockerfile):
    assert copy_problems(dockerfile.read_text()) == []


def test_a_dockerfile_copying_what_does_not_exist_is_caught():
    text = DOCKERFILES[0].read_text()
    broken = text.replace("COPY sim sim", "COPY simulator simulator").replace(
        "/src/build/default/lib/libvgpu.so", "/src/build/default/lib/libvgpu-core.so")
    assert copy_problems(broken) == ["COPY simulator: not in the repository",
                                     "COPY --from /src/build/default/lib/libvgpu-core.so: not an artifact of the "
                                     "default preset"]


def test_the_builds_configure_everything_the_top_cmakelists_always_adds():
    top = (REPO_ROOT / "CMakeLists.txt").read_text()
    always = {"fakecuda", "vgpu-core", "sim"}
    assert always <= set(re.findall(r"^add_subdirectory\((\S+)\)", top, re.M))
    for dockerfile in DOCKERFILES:
        copied = set(re.findall(r"^COPY (\S+) \S+$", dockerfile.read_text(), re.M))
        assert always | {"cmake"} <= copied, f"{dockerfile.name} copies {copied}"
        assert "-DVGPU_BUILD_TESTS=OFF" in dockerfile.read_text()


def test_the_plugin_image_replaces_the_library_where_vgpu_init_copies_from():
    text = DOCKERFILES[0].read_text()
    # docker/vgpu-init.sh (HAMi 4707fb0): SOURCE_DIR="/k8s-vgpu/lib/nvidia", copied to <gpuHookPath>/vgpu.
    assert "for f in /k8s-vgpu/lib/nvidia/libvgpu.so*" in text
    assert "GLIBC_2.28" in text, "the glibc check on the preloaded library is gone"


# ---------------------------------------------------------------------------------------------- vgpu-registrar

POD_UID = "11111111-2222-3333-4444-555555555555"
CONTAINER_ID = "a" * 64
GPU_A = "GPU-5f0c1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b"
GPU_B = "GPU-77aa1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b"


@pytest.fixture
def registrar():
    spec = importlib.util.spec_from_file_location("vgpu_registrar", DEPLOY / "monitor" / "registrar.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def hami_pod(uid: str = POD_UID, allocation: str = f"{GPU_A},NVIDIA,3000,30:{GPU_B},NVIDIA,4000,30:;",
             container: str = "trainer", init: bool = False) -> dict:
    """A pod as HAMi leaves it: the scheduler's allocation annotation (pkg/device/devices.go's encoding)."""
    containers = [{"name": container}]
    return {
        "metadata": {"name": "p", "namespace": "team-a", "uid": uid,
                     "annotations": {"hami.io/vgpu-devices-allocated": (";" if init else "") + allocation}},
        "spec": {"initContainers": [{"name": "setup"}] if init else [], "containers": containers},
        "status": {"phase": "Running",
                   "containerStatuses": [{"name": container, "containerID": f"containerd://{CONTAINER_ID}"}]},
    }


@pytest.fixture
def node(tmp_path):
    """A node's folders: a cgroup v2 tree holding the container's scope (systemd driver), the containers and verdicts
    folders."""
    cgroup = tmp_path / "cgroup"
    scope = (f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice/"
             f"cri-containerd-{CONTAINER_ID}.scope")
    (cgroup / scope).mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "containers").mkdir()
    (tmp_path / "verdicts").mkdir()
    return tmp_path, "/" + scope


def test_the_registrar_writes_what_hami_gave_the_container(registrar, node):
    root, scope = node
    registrar.sync([hami_pod(init=True)], root / "containers", root / "verdicts", root / "cgroup", set())
    files = list((root / "containers").iterdir())
    assert [f.name for f in files] == [f"{POD_UID}_trainer.conf"]
    assert files[0].read_text().splitlines()[1:] == [
        f"VGPU_CGROUP={scope}", f"VGPU_DEVICES={GPU_A},{GPU_B}",
        "VGPU_POD_NAMESPACE=team-a", "VGPU_POD_NAME=p", "VGPU_CONTAINER_NAME=trainer",
        f"VGPU_CACHE=/usr/local/vgpu/containers/{POD_UID}_trainer",
        "CUDA_DEVICE_MEMORY_LIMIT_0=3000m", "CUDA_DEVICE_MEMORY_LIMIT_1=4000m", "CUDA_DEVICE_SM_LIMIT=30"]


def test_the_registrar_skips_what_the_monitor_cannot_judge_and_cleans_up_only_its_own(registrar, node):
    root, _ = node
    containers, verdicts = root / "containers", root / "verdicts"
    hand_written = containers / "by-hand.conf"
    hand_written.write_text("VGPU_CGROUP=/x\n")
    gone = "99999999-2222-3333-4444-555555555555"
    (containers / f"{gone}_old.conf").write_text(f"{registrar.MARKER}: gone\nVGPU_CGROUP=/y\n")
    (verdicts / f"{gone}_old").mkdir()
    (verdicts / f"{gone}_old" / "verdict").write_text("vgpu-verdict 1\n")
    pods = [hami_pod(container="a-container-name-of-28-chars"),
            hami_pod(uid=POD_UID.replace("1", "7"), allocation="MIG-aaa,NVIDIA,3000,50:;")]
    reported: set[str] = set()
    registrar.sync(pods, containers, verdicts, root / "cgroup", reported)
    assert sorted(p.name for p in containers.iterdir()) == ["by-hand.conf"]
    assert not (verdicts / f"{gone}_old").exists()
    assert len(reported) == 2 and any("longer than" in r for r in reported) and any("MIG" in r for r in reported)


def test_the_monitor_accepts_the_registrars_file(registrar, node, fake_gpu, build_dir):
    """The file, read by the real vgpu-monitor (fakecuda's NVML): no complaint, and a verdict for the container."""
    monitor = build_dir / "bin" / "vgpu-monitor"
    if not monitor.exists():
        pytest.skip(f"vgpu-monitor is not built: {monitor} is missing")
    # The registrar writes the keys of this tree's monitor; a binary older than the parser's sources may not know them.
    sources = [p for folder in ("vgpu-core/monitor", "vgpu-core/policy") for p in (REPO_ROOT / folder).rglob("*.[ch]*")]
    newer = [str(p.relative_to(REPO_ROOT)) for p in sources if p.stat().st_mtime > monitor.stat().st_mtime]
    if newer:
        pytest.skip(f"{monitor} is older than {', '.join(sorted(newer)[:3])}{' ...' if len(newer) > 3 else ''}: rebuild")
    root, _ = node
    registrar.sync([hami_pod()], root / "containers", root / "verdicts", root / "cgroup", set())
    result = fake_gpu.run(monitor, "--containers", root / "containers", "--verdicts", root / "verdicts",
                          "--periods", "2", "--period-ms", "10", timeout=30)
    assert "container file" not in result.stderr, result.stderr
    assert (root / "verdicts" / f"{POD_UID}_trainer" / "verdict").read_text().startswith("vgpu-verdict 1\n")


def test_the_registrar_writes_only_keys_this_trees_monitor_knows(registrar, node):
    """Offline, whatever the build: every VGPU_* key written is one vgpu-core/monitor/monitor.cc parses (the monitor
    skips a whole container over one unknown key), the CUDA_* ones the shim's configuration names."""
    root, _ = node
    registrar.sync([hami_pod()], root / "containers", root / "verdicts", root / "cgroup", set())
    written = {line.split("=", 1)[0] for line in next((root / "containers").iterdir()).read_text().splitlines()
               if not line.startswith("#")}
    monitor_keys = set(re.findall(r'constexpr std::string_view k\w+Key = "(\w+)"',
                                  (REPO_ROOT / "vgpu-core/monitor/monitor.cc").read_text()))
    shim_keys = {"CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_MEMORY_LIMIT_1", "CUDA_DEVICE_SM_LIMIT"}
    assert written - shim_keys <= monitor_keys, f"unknown to the monitor: {written - shim_keys - monitor_keys}"
    assert "CUDA_DEVICE_MEMORY_LIMIT" in (REPO_ROOT / "vgpu-core/policy/config.cc").read_text()
