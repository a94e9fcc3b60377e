"""A local GCS server for tests (gcp-storage-emulator in memory, started by tests/gcs_emulator_server.py):
what gcsfs and TensorStore talk to in a process (and its children) with the environment `GcsEmulator.env`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

BUCKET = "areal-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        server = os.path.join(os.path.dirname(__file__), "gcs_emulator_server.py")
        self.process = subprocess.Popen(
            [sys.executable, server, str(self.port), BUCKET], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b/{BUCKET}", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.close()
                    raise RuntimeError("the GCS emulator did not start") from None
                time.sleep(0.1)

    @property
    def env(self) -> dict[str, str]:
        """What points gcsfs (STORAGE_EMULATOR_HOST) and TensorStore (TENSORSTORE_GCS_HTTP_URL) here;
        gcsfs's bucket-type probe (a gRPC call the emulator does not serve) and google-auth's metadata-server
        probe off (the tests use no credentials)."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "GOOGLE_CLOUD_PROJECT": "areal-test",
            "NO_GCE_CHECK": "true",  # google-auth: no probe of a GCE metadata server for credentials
        }

    def apply(self) -> None:
        os.environ.update(self.env)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
