"""The networked commands' own keys and files: certificates as documented, one-line refusals."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from splitlab.cli import main


def test_certs_are_signed_by_the_ca_and_name_each_client(tmp_path):
    assert main(["certs", f"out={tmp_path}", "clients=2", "hosts=node.example.org,10.0.0.7"]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "node.example.org"}
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.0.0.7"}
    for k in range(2):
        cert = x509.load_pem_x509_certificate((tmp_path / f"client-{k}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"client-{k}"
        assert stat.S_IMODE((tmp_path / f"client-{k}.key").stat().st_mode) == 0o600
    assert not (tmp_path / "client-2.pem").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["certs", "clients=0"], "invalid value 0 for clients: expected a whole number of clients, 1 to 1000"),
        (["certs", "client=2"], "unknown key 'client' for certs"),
        (
            ["client", "connect=127.0.0.1:1", "certs=/nonexistent"],
            "certificate file '/nonexistent/ca.pem' does not exist",
        ),
        (["client", "port=7070"], "unknown key 'port' for client"),
        (["client", "client_id=-1"], "invalid value -1 for client_id"),
        (["client", "data=mine"], "invalid value 'mine' for data: Input should be 'partition' or 'own'"),
        (["client", "data=own"], "data=own needs data_dir=DIR, the folder of this client's own files"),
        (["run", "data=mine"], "invalid value 'mine' for data: Input should be 'partition' or 'own'"),
        (
            ["run", "data=own"],
            "data=own: the clients bring their own samples to a server; run it with `splitlab server`",
        ),
        (["server", "listen=127.0.0.1:1", "min_clients=0"], "invalid value 0 for min_clients"),
        (["server", "listen=127.0.0.1:1", "rounds=0"], "invalid value 0 for rounds"),
        (["launch", "threads=0"], "invalid value 0 for threads"),
        (["launch", "data=own"], "launch gives every client the run's data_dir; with data=own start each client"),
    ],
)
def test_bad_settings_are_refused_in_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_server_refuses_an_address_it_cannot_listen_on(tmp_path, capsys):
    main(["certs", f"out={tmp_path / 'certs'}", "clients=1"])
    argv = ["server", "dataset=synthetic", "model=mlp", "clients=1", f"certs={tmp_path / 'certs'}", "listen=nowhere"]
    assert main([*argv, f"out={tmp_path / 'run'}"]) == 2
    assert "cannot listen on listen='nowhere'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
