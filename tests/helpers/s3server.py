"""A real S3 API server (moto) on 127.0.0.1 in a subprocess, for tests that go through s3fs.

Use the ``s3_server`` fixture (``from helpers.s3server import s3_server``): it starts one server per
session on a free port and stops it at the end. ``server.storage_options`` are what s3fs needs;
``server.upload(local_dir, "bucket/prefix")`` copies a packed dataset in.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

CREDS = {"key": "testing", "secret": "testing"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def storage_options(self) -> dict:
        return {
            **CREDS,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def start(self, timeout: float = 30.0) -> S3Server:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with code {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not listen on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def upload(self, local_dir: str, dest: str) -> str:
        """Copy ``local_dir`` to ``s3://dest`` (creating the bucket); returns the s3:// URL."""
        fs = self.fs()
        bucket = dest.split("/", 1)[0]
        if not fs.exists(bucket):
            fs.call_s3("create_bucket", Bucket=bucket)  # us-east-1 takes no LocationConstraint
        for root, _, files in os.walk(local_dir):
            for fn in files:
                p = os.path.join(root, fn)
                rel = os.path.relpath(p, local_dir).replace(os.sep, "/")
                fs.put_file(p, f"{dest}/{rel}")
        return f"s3://{dest}"


@pytest.fixture(scope="session")
def s3_server():
    import moto  # noqa: F401  declared test dependencies (pyproject [test]): missing ones are a broken
    import s3fs  # noqa: F401  install, an error here, never a quiet skip

    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()
