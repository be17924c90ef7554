"""moto's S3 server as a real HTTP process (``python -m moto.server``) and the dummy AWS
environment the S3 tests run in: fixtures ``aws_env`` (a module marks itself with
``pytestmark = pytest.mark.usefixtures("aws_env")``) and ``moto``, both registered by
conftest."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from kvserve.testing.procs import free_port, kill_process, stop_process, wait_until

READY_TIMEOUT_S = 60.0  # moto imports a lot; the machine may be busy
BUCKET = "kvserve-test"


@pytest.fixture(scope="module")
def aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Dummy credentials, no profile/config files, no proxy for loopback."""
    empty = tmp_path_factory.mktemp("aws") / "none"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_CONFIG_FILE", str(empty))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
            mp.delenv(var, raising=False)
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))
        mp.setenv("NO_PROXY", no_proxy)
        mp.setenv("no_proxy", no_proxy)
        yield


class MotoServer:
    """``python -m moto.server`` on a loopback port (restartable on the same port)."""

    def __init__(self, log: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._ready, READY_TIMEOUT_S, f"moto server ready ({self.log})")
        self.s3().create_bucket(Bucket=BUCKET)

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"moto server exited:\n{self.log.read_text()[-3000:]}")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.endpoint + "/", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def s3(self):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def url(self, prefix: str, **query: object) -> str:
        query = {"endpoint_url": self.endpoint, "region": "us-east-1", **query}
        return f"s3://{BUCKET}/{prefix}?" + "&".join(f"{k}={v}" for k, v in query.items())

    def kill(self) -> None:
        kill_process(self.proc)

    def stop(self) -> None:
        stop_process(self.proc)


@contextlib.contextmanager
def moto_server(log: Path) -> Iterator[MotoServer]:
    server = MotoServer(log)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server
