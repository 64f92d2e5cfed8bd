"""`splitlab launch`: a server and its clients as processes on this machine, over loopback.

Certificates are made in the run directory (`OUT/certs`, kept across resumes), the server
listens on a free loopback port, and every client is `splitlab client` with its own certificate:
the same code paths as a deployment on several machines. Each process uses one torch thread
unless `threads=` says otherwise. The exit code is the server's. With data=own, `data_dirs=`
names one folder per client (a vertical run: per party, its own columns), each client started
with `data=own data_dir=` its folder; the run's `data_dir=` stays the server's (its test set, or
a vertical run's ids and labels with labels_at=server).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from splitlab.errors import UserError
from splitlab.net.certs import CA, make_certs
from splitlab.resolve import resolve_config


class LaunchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    threads: int = Field(1, ge=1, le=1024, description="torch threads per process")
    data_dirs: str | None = Field(
        None,
        description="data=own: each client's (vertical: each party's) own folder, in client order, comma-separated",
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _own_folders(data: str, data_dirs: str | None) -> list[Path]:
    """Each client's own folder (data=own: one per client, existing), or none (data=partition)."""
    if data != "own":
        if data_dirs is not None:
            raise UserError("data_dirs= gives each client (vertical: each party) its own folder; it needs data=own")
        return []
    if data_dirs is None:
        raise UserError(
            "launch data=own needs data_dirs=DIR0,DIR1,...: each client's (vertical: each party's) own folder, in order"
        )
    folders = [Path(part.strip()) for part in data_dirs.split(",")]
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"data_dirs=: {str(folder)!r} is not a folder")
    return folders


def launch(raw: Mapping[str, Any], server_keys: Mapping[str, Any], settings: LaunchSettings, progress: bool) -> int:
    """Start the server and one client process per client; wait for all; the server's exit code."""
    from splitlab.build import client_count

    config = resolve_config(raw)
    own = _own_folders(config.run.data, settings.data_dirs)
    clients = client_count(raw)
    if own and len(own) != clients:
        raise UserError(f"data_dirs= names {len(own)} folders; this run has {clients} nodes, one folder each")
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
            + (
                ["data=own", f"data_dir={own[k]}"]
                if own
                else [f"data_dir={config.run.data_dir}"]
                if config.run.data_dir
                else []
            ),
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
