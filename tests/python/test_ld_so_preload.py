"""The route HAMi really uses (issue 21, docs/hami-env.md): no LD_PRELOAD; the device plugin mounts the library at
/usr/local/vgpu/libvgpu.so, the container's folder at /usr/local/vgpu and a file naming the library at
/etc/ld.so.preload (Project-HAMi/HAMi pkg/device-plugin/nvidiadevice/nvinternal/plugin/server.go, Allocate).

The same mounts are made here in a private mount namespace of an unprivileged user namespace (`unshare --user
--map-root-user --mount`), over fakecuda. The host's /etc and /usr/local are never written: their mount points are
made in overlays whose upper layers live on a tmpfs of the namespace, gone with it. Skipped, with the reason, where
unshare, user namespaces or overlayfs in them are not available (CI runners often forbid user namespaces)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest

from test_hami_env import CACHE_MAGIC, GIB, MIB, PROBE

SKIP_EXIT = 77

# Runs inside the namespace: $1 the test's folder, $2 the built libvgpu.so, $3 "preload" or "none"; then the command.
CONTAINER_MOUNTS = r"""
set -u
root=$1 shim=$2 preload=$3
shift 3
skip() { echo "cannot make the container's mounts: $*" >&2; exit 77; }
mount -t tmpfs tmpfs "$root/scratch" || skip "tmpfs"
mkdir -p "$root/scratch/etc-upper" "$root/scratch/etc-work" "$root/scratch/local-upper" "$root/scratch/local-work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$root/scratch/etc-upper,workdir=$root/scratch/etc-work" /etc ||
  skip "overlayfs on /etc in a user namespace (Linux 5.11 or later)"
mount -t overlay overlay \
  -o "lowerdir=/usr/local,upperdir=$root/scratch/local-upper,workdir=$root/scratch/local-work" /usr/local ||
  skip "overlayfs on /usr/local"
# HAMi's mounts: the container's folder read-write, the library read-only inside it, and /etc/ld.so.preload.
mkdir -p /usr/local/vgpu && mount --bind "$root/container" /usr/local/vgpu || skip "bind /usr/local/vgpu"
touch /usr/local/vgpu/libvgpu.so && mount --bind -o ro "$shim" /usr/local/vgpu/libvgpu.so || skip "bind the library"
rm -f /etc/ld.so.preload
if [ "$preload" = preload ]; then
  touch /etc/ld.so.preload && mount --bind -o ro "$root/ld.so.preload" /etc/ld.so.preload || skip "bind ld.so.preload"
fi
exec "$@"
"""


def namespaces_reason() -> str | None:
    """None if this machine lets us make a user and mount namespace, else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "unshare (util-linux) is not installed"
    try:
        probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "true"], capture_output=True,
                               text=True, timeout=30)
    except OSError as error:
        return f"unshare cannot run: {error}"
    if probe.returncode != 0:
        return f"user namespaces are not available here: {probe.stderr.strip() or probe.returncode}"
    return None


@pytest.fixture
def hami_container(fake_gpu, shim_path):
    """Runs PROBE as one process of a container set up as HAMi sets it up; `run(preload=...)` gives its report and
    stderr. The environment is HAMi's (a 1024m limit, its cache path under /usr/local/vgpu), and no LD_PRELOAD."""
    reason = namespaces_reason()
    if reason is not None:
        pytest.skip(reason)
    root = fake_gpu.work_dir
    for folder in ("scratch", "container"):
        (root / folder).mkdir()
    (root / "ld.so.preload").write_text("/usr/local/vgpu/libvgpu.so\n")  # as the host's /usr/local/vgpu/ld.so.preload
    cache_name = "4f1c2a9e-5b7d-4c3e-9a21-0d8e6f7b3c55.cache"
    fake_gpu.env.update({"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m", "CUDA_DEVICE_SM_LIMIT": "100",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/usr/local/vgpu/{cache_name}"})
    assert "LD_PRELOAD" not in fake_gpu.env

    def run(preload: bool):
        result = fake_gpu.run("unshare", "--user", "--map-root-user", "--mount", "sh", "-c", CONTAINER_MOUNTS, "sh",
                              str(root), str(shim_path), "preload" if preload else "none",
                              sys.executable, "-c", PROBE, json.dumps({"0": GIB}), timeout=60, check=False)
        if result.returncode == SKIP_EXIT:
            pytest.skip(result.stderr.strip())
        assert result.returncode == 0, result.describe()
        return result.json, result.stderr

    run.cache_file = root / "container" / cache_name
    return run


def test_the_shim_named_in_etc_ld_so_preload_is_loaded_and_enforces(hami_container):
    report, stderr = hami_container(preload=True)
    assert report["ld_preload"] is None, report
    assert report["shim_mapped"] == ["/usr/local/vgpu/libvgpu.so"], report
    device = report["devices"][0]
    assert device["total"] == device["nvml_total"] == 1024 * MIB, device
    assert device["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY", device
    # The cache file is in the container's folder, where HAMi's monitor looks for it on the host.
    data = hami_container.cache_file.read_bytes()
    assert struct.unpack_from("<i", data, 0)[0] == CACHE_MAGIC, stderr


def test_without_etc_ld_so_preload_the_same_container_is_not_capped(hami_container):
    """The converse, so that the test above can fail: the same mounts and environment without /etc/ld.so.preload
    (HAMi's CUDA_DISABLE_CONTROL=true container) load no shim and see the whole device."""
    report, _ = hami_container(preload=False)
    assert report["shim_mapped"] == [], report
    device = report["devices"][0]
    assert device["total"] > 1024 * MIB and device["alloc"] == "CUDA_SUCCESS", device
    assert not hami_container.cache_file.exists()
