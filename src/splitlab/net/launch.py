"""`splitlab launch`: a server and its clients as processes on this machine, over loopback.

Certificates are made in the run directory (`OUT/certs`, kept across resumes), the server
listens on a free loopback port, and every client is `splitlab client` with its own certificate:
the same code paths as a deployment on several machines. Each process uses one torch thread
unless `threads=` says otherwise. The exit code is the server's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from splitlab.errors import UserError
from splitlab.net.certs import CA, make_certs
from splitlab.resolve import resolve_config


class LaunchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    threads: int = Field(1, ge=1, le=1024, description="torch threads per process")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launch(raw: Mapping[str, Any], server_keys: Mapping[str, Any], settings: LaunchSettings, progress: bool) -> int:
    """Start the server and one client process per client; wait for all; the server's exit code."""
    from splitlab.build import client_count

    config = resolve_config(raw)
    if config.run.data == "own":
        raise UserError(
            "launch gives every client the run's data_dir; with data=own start each client with its own: "
            "splitlab client data=own data_dir=DIR ... (docs/deployment.md)"
        )
    clients = client_count(raw)
    certs = config.out_dir / "certs"
    if not (certs / f"{CA}.pem").exists() or not (certs / f"client-{clients - 1}.pem").exists():
        make_certs(certs, clients, [], overwrite=True)  # the run's own, for more clients than before
    address = f"127.0.0.1:{_free_port()}"
    keys = [f"{k}={v}" for k, v in {**raw, **server_keys}.items() if v is not None]
    splitlab = [sys.executable, "-m", "splitlab"]
    env = {**os.environ, "OMP_NUM_THREADS": str(settings.threads)}
    flags = [] if progress else ["--no-progress"]
    server = subprocess.Popen([*splitlab, "server", *keys, f"listen={address}", f"certs={certs}", *flags], env=env)
    nodes = [
        subprocess.Popen(
            [
                *splitlab,
                "client",
                f"connect={address}",
                f"client_id={k}",
                f"certs={certs}",
                f"threads={settings.threads}",
            ]
            + ([f"data_dir={config.run.data_dir}"] if config.run.data_dir else []),
            env=env,
        )
        for k in range(clients)
    ]
    code = 1
    try:
        code = server.wait()
    finally:
        for node in nodes:  # told BYE by a server that ran; left retrying by one that failed to start
            try:
                node.wait(timeout=30 if code in (0, 4) else 0.1)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
    return code
