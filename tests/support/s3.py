"""A real S3-compatible server for the tests: moto in server mode, a process of its own on
127.0.0.1. Nodes reach it through the standard AWS variables (`env`), as they would reach S3."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Optional

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.url}

    def start(self, timeout_s: float = 60.0) -> "S3Server":
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                httpx.get(self.url, timeout=1.0)
                return self
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the S3 server did not start on {self.url}")
                time.sleep(0.2)

    def filesystem(self):
        """An s3fs filesystem on this server (the tests' own client, as users' tools would be)."""
        import s3fs

        return s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=self.url, use_listings_cache=False)

    def bucket(self) -> str:
        name = f"agora-{uuid.uuid4().hex[:8]}"
        self.filesystem().mkdir(name)
        return name

    def apply_env(self) -> dict[str, str]:
        """Set the AWS variables in this process too (for fsspec calls the test makes itself)."""
        previous = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        return previous

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
