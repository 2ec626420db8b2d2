"""The deploy files: the Kubernetes manifests against the Kubernetes schemas (offline,
kubernetes-validate's bundled ones) and against each other and the daemon's flags; the
systemd units (systemd-analyze, where this host has it); the Dockerfile (it cannot be
built without a Docker engine: what it copies builds this package, with its entrypoint);
and the health command the probes run."""

import copy
import importlib.metadata
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import zipfile

import kubernetes_validate
import pytest
import yaml

from bubblesnap import cli
from bubblesnap.service import DiscoveryOptions
from bubblesnap.service.durable import storage
from bubblesnap.shared.sizes import parse_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
#: The oldest Kubernetes minor still supported upstream when written, and the newest
#: schemas kubernetes-validate bundles.
VERSIONS = ["1.31", kubernetes_validate.latest_version()]


def _documents(name: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / name)
                                                           .read_text())}


DAEMON = _documents("bubblesnap.yaml")
TRAINER = _documents("trainer.yaml")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("doc", [*DAEMON.values(), *TRAINER.values()],
                         ids=lambda d: d["kind"] if isinstance(d, dict) else d)
def test_the_manifests_validate_against_the_kubernetes_schemas(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_catches_a_misspelt_field():
    broken = copy.deepcopy(DAEMON["DaemonSet"])
    broken["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def _pod(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]


def _container(doc: dict) -> dict:
    [container] = _pod(doc)["containers"]
    return container


def _daemon_args() -> list[str]:
    """The DaemonSet's daemon arguments with the $(VAR)s the kubelet fills in filled."""
    config = DAEMON["ConfigMap"]["data"]
    values = {"POD_IP": "10.0.0.7"}
    for env in _container(DAEMON["DaemonSet"])["env"]:
        ref = env["valueFrom"].get("configMapKeyRef")
        if ref:
            assert ref["name"] == DAEMON["ConfigMap"]["metadata"]["name"]
            values[env["name"]] = config[ref["key"]]
        else:
            assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a)
            for a in _container(DAEMON["DaemonSet"])["args"]]


def test_the_daemonset_flags_are_the_daemons_and_find_the_peers_from_the_service():
    args = cli.parser().parse_args(["daemon", *_daemon_args()])  # SystemExit on a bad flag
    service, daemonset = DAEMON["Service"], DAEMON["DaemonSet"]
    found = DiscoveryOptions(service=args.peers_from_dns, own_address=args.own_address,
                             expected=args.peers_expected)
    name = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert found.service.rpartition(":")[0] == name
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert found.port == ports["peer"] == int(args.peer_listen.rpartition(":")[2])
    assert int(args.data_listen.rpartition(":")[2]) == ports["data"]
    assert int(args.metrics.rpartition(":")[2]) == ports["metrics"]
    assert service["spec"]["clusterIP"] == "None"           # headless: every pod's IP
    assert service["spec"]["publishNotReadyAddresses"] is True
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The ring is ordered by IP, stable across a pod's restart only on the host network.
    assert _pod(daemonset)["hostNetwork"] is True
    assert _pod(daemonset)["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert not args.peers and args.index is None


def test_probes_ask_the_grpc_health_service_and_wait_out_discovery():
    daemon = _container(DAEMON["DaemonSet"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = daemon[probe]["exec"]["command"]
        assert command[:2] == ["bubblesnap", "health"], probe
        cli.parser().parse_args(command[1:])
    startup = daemon["startupProbe"]
    timeout = cli.parser().parse_args(["daemon", *_daemon_args()]).discovery_timeout
    assert startup["periodSeconds"] * startup["failureThreshold"] > timeout


def _mounts(doc: dict) -> dict[str, dict]:
    """mount path -> the volume mounted there, of the pod's main container."""
    volumes = {v["name"]: v for v in _pod(doc)["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in _container(doc)["volumeMounts"]}


def test_trainers_share_the_daemons_socket_and_segments_as_its_user():
    args = cli.parser().parse_args(["daemon", *_daemon_args()])
    uid = _pod(DAEMON["DaemonSet"])["securityContext"]["runAsUser"]
    assert _pod(TRAINER["Pod"])["securityContext"]["runAsUser"] == uid
    socket = args.listen.removeprefix("unix://")
    folder = str(pathlib.PurePosixPath(socket).parent)
    # The clients' default address for that uid, so trainers need no --daemon.
    assert socket == f"/dev/shm/bubblesnap-user-{uid}/daemon.sock"
    assert args.shm_dir == folder
    daemon_volume, trainer_volume = _mounts(DAEMON["DaemonSet"])[folder], \
        _mounts(TRAINER["Pod"])[folder]
    assert daemon_volume["hostPath"]["path"] == trainer_volume["hostPath"]["path"]
    # Memory-backed: the node's /dev/shm (tmpfs), or the sized tmpfs of the mount unit.
    mount = (DEPLOY / "systemd" / "dev-shm-bubblesnap.mount").read_text()
    assert f"Where={daemon_volume['hostPath']['path']}" in mount
    assert re.search(r"^Type=tmpfs$", mount, re.M) and re.search(r"size=\d+G", mount)
    assert TRAINER["Pod"]["spec"]["nodeSelector"] == _pod(DAEMON["DaemonSet"])["nodeSelector"]


def test_the_durable_tier_is_a_bucket_the_pods_reach_as_their_service_account():
    args = cli.parser().parse_args(["daemon", *_daemon_args()])
    assert storage.split_url(args.durable_dir)[0] == "s3" and args.durable_every_steps > 0
    account = DAEMON["ServiceAccount"]
    assert _pod(DAEMON["DaemonSet"])["serviceAccountName"] == account["metadata"]["name"]
    assert account["metadata"]["namespace"] == DAEMON["DaemonSet"]["metadata"]["namespace"]
    assert "eks.amazonaws.com/role-arn" in account["metadata"]["annotations"]  # IRSA
    env = {e["name"] for e in _container(DAEMON["DaemonSet"])["env"]}
    assert "AWS_REGION" in env and not env & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def test_the_peer_token_and_tls_come_from_secrets():
    args = cli.parser().parse_args(["daemon", *_daemon_args()])
    mounts = _mounts(DAEMON["DaemonSet"])
    for path in (args.peer_token_file, args.peer_tls_cert, args.peer_tls_key, args.peer_tls_ca):
        folder = str(pathlib.PurePosixPath(path).parent)
        assert "secret" in mounts[folder], path
    assert args.peer_tls_client_auth


def test_the_dockerfile_installs_this_package_and_runs_its_daemon_as_not_root():
    text = (DEPLOY / "Dockerfile").read_text()
    steps = [line.split(None, 1) for line in text.splitlines()
             if line.strip() and not line.startswith("#")]
    assert re.fullmatch(r"python:3\.\d+-slim", dict(steps)["FROM"])
    user = dict(steps)["USER"].split(":")[0]
    assert user not in ("0", "root")
    assert _pod(DAEMON["DaemonSet"])["securityContext"]["runAsUser"] == int(user)
    assert yaml.safe_load(dict(steps)["ENTRYPOINT"]) == ["bubblesnap", "daemon"]
    [script] = importlib.metadata.entry_points(group="console_scripts", name="bubblesnap")
    assert script.value == "bubblesnap.cli:main"
    copied = [src for kind, rest in steps if kind == "COPY" for src in rest.split()[:-1]]
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert all(f"!{src}" in ignore or f"!{src}/**" in ignore for src in copied)


def test_what_the_dockerfile_copies_builds_the_package_with_its_entrypoint(tmp_path):
    """The image's pip install, without Docker: a wheel built from the copied files alone."""
    steps = [line.split()[1:] for line in (DEPLOY / "Dockerfile").read_text().splitlines()
             if line.startswith("COPY ")]
    source = tmp_path / "src"
    source.mkdir()
    for *sources, _ in steps:
        for name in sources:
            (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
                ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path / "wheel"),
                    str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "wheel").glob("bubblesnap-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("bubblesnap/cli/status_command.py", "bubblesnap/service/daemon.py",
                   "bubblesnap/service/peers/discovery.py", "bubblesnap/protos/daemon_pb2.py",
                   "bubblesnap/clients/numpy_client.py", "bubblesnap/clients/jax/client.py"):
        assert module in names
    [entry_points] = [n for n in names if n.endswith("entry_points.txt")]
    assert "bubblesnap = bubblesnap.cli:main" in zipfile.ZipFile(wheel).read(
        entry_points).decode()


def _exec_start(unit: str) -> list[str]:
    """The unit's ExecStart command line, its continuation lines joined."""
    text = (DEPLOY / "systemd" / unit).read_text().replace("\\\n", " ")
    [line] = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def test_the_systemd_unit_runs_the_daemon_with_its_flags():
    env = dict(line.split("=", 1) for line in (DEPLOY / "systemd" / "bubblesnap.env")
               .read_text().splitlines() if line and not line.startswith("#"))
    command = _exec_start("bubblesnap@.service")
    assert command[0].endswith("/bin/bubblesnap") and command[1] == "daemon"
    words = []
    for word in command[2:]:
        if word.startswith("$"):  # ${X}: one word; $X: split at whitespace (systemd's rule)
            value = env[word.strip("${}")]
            words += [value] if word.startswith("${") else value.split()
        else:
            words.append(word.replace("%i", "alice"))
    args = cli.parser().parse_args(["daemon", *words])
    assert args.shm_dir == "/dev/shm/bubblesnap/alice"
    assert storage.split_url(args.durable_dir)[0] == "s3" and "AWS_REGION" in env
    assert args.memory_budget == parse_bytes(env["BUBBLESNAP_MEMORY_BUDGET"])
    mount = (DEPLOY / "systemd" / "dev-shm-bubblesnap.mount").read_text()
    size = re.search(r"size=(\d+G)", mount).group(1)
    assert args.memory_budget < parse_bytes(size + "iB")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_finds_nothing_wrong_with_the_units(tmp_path):
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout
    units = []
    for unit, name in (("dev-shm-bubblesnap.mount", "dev-shm-bubblesnap.mount"),
                       ("bubblesnap@.service", f"bubblesnap@{user.strip()}.service")):
        # It checks that ExecStart's program exists: point it at this environment's.
        text = (DEPLOY / "systemd" / unit).read_text().replace(
            "/opt/bubblesnap/bin/bubblesnap", str(pathlib.Path(sys.executable).parent /
                                                  "bubblesnap"))
        (tmp_path / name).write_text(text)
        units.append(str(tmp_path / name))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", *units],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")


def test_the_deploy_page_of_the_docs_shows_every_deploy_file():
    page = (ROOT / "docs" / "operating" / "deploy.md").read_text()
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert path.name in page, path


def _health(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bubblesnap", "health", "--timeout", "5",
                           *flags], capture_output=True, text=True, timeout=60)


def test_the_health_command_says_whether_the_daemon_serves(start_daemon):
    daemon = start_daemon()
    serving = _health("--daemon", daemon.address)
    assert (serving.returncode, serving.stdout) == (0, "SERVING\n")
    unknown = _health("--daemon", daemon.address, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    address = daemon.address
    daemon.stop()
    gone = _health("--daemon", address)
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def test_the_mount_unit_gives_segments_huge_pages(tmp_path):
    """The unit's tmpfs, mounted with its own options (its size cut to fit here), gives
    the daemon's segments huge pages, as the daemon detects them (service/store/pages.py)."""
    from bubblesnap.service.store import pages
    unit = (DEPLOY / "systemd" / "dev-shm-bubblesnap.mount").read_text()
    options = re.search(r"^Options=(.*)$", unit, re.M).group(1).split(",")
    assert "huge=within_size" in options
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "shm"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(
        "size=64m" if o.startswith("size=") else o for o in options), "tmpfs", str(where)],
        capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        found = pages.detect(str(where))
        assert (found.filesystem, found.huge) == ("tmpfs", "within_size")
        if pages._sysfs_choice("/sys/kernel/mm/transparent_hugepage/shmem_enabled") != "deny":
            assert found.huge_pages, found
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
