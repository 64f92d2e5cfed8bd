"""The networked commands' own keys and files: certificates as documented, one-line refusals."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from splitlab.cli import main
from splitlab.net.certs import read_pair


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
        (["certs", "clients=0"], "invalid value 0 for clients: Input should be greater than or equal to 1"),
        (["certs", "client=2"], "unknown key 'client'; did you mean 'clients'?"),
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
        (["launch", "data=own"], "launch data=own needs data_dirs=DIR0,DIR1,...: each client's (vertical: each"),
        (["launch", "data_dirs=a,b"], "data_dirs= gives each client (vertical: each party) its own folder; it needs"),
        (["client", "connect=127.0.0.1"], "connect='127.0.0.1' is not HOST:PORT with a port from 1 to 65535"),
        (["client", "connect=127.0.0.1:99999"], "connect='127.0.0.1:99999' is not HOST:PORT"),
        (["server", "listen=:7070"], "listen=':7070' is not HOST:PORT"),
        (["certs", "hosts=node_1.example"], "hosts: 'node_1.example' is neither an IP address nor a DNS name"),
        (["certs", "hosts=-bad.example"], "hosts: '-bad.example' is neither"),
        (["certs", "overwrite=maybe"], "invalid value 'maybe' for overwrite"),
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
    assert "listen='nowhere' is not HOST:PORT" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_certs_never_replace_a_ca_unless_asked_and_take_idna_hosts(tmp_path, capsys):
    assert main(["certs", f"out={tmp_path}", "hosts=bücher.example"]) == 0
    ca = (tmp_path / "ca.pem").read_bytes()
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "xn--bcher-kva.example" in names.get_values_for_type(x509.DNSName)
    assert main(["certs", f"out={tmp_path}"]) == 2
    assert "ca.pem' exists: a new CA would make every key it issued useless" in capsys.readouterr().err
    assert (tmp_path / "ca.pem").read_bytes() == ca
    assert main(["certs", f"out={tmp_path}", "clients=3"]) == 2
    assert main(["certs", f"out={tmp_path}", "overwrite=true", "clients=3"]) == 0
    assert (tmp_path / "ca.pem").read_bytes() != ca
    assert main(["certs", f"out={tmp_path}", "overwrite=true", "clients=1"]) == 0  # the old CA's client-1, -2 go
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ca.key",
        "ca.pem",
        "client-0.key",
        "client-0.pem",
        "server.key",
        "server.pem",
    ]
    read_pair(tmp_path, "client-0")  # signed by the new CA
    assert main(["certs", f"out={tmp_path / 'ca.pem'}"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def _mixed_certs(tmp_path, swap: str) -> str:
    """A certificate folder with one file (`swap`) from another CA's set."""
    main(["certs", f"out={tmp_path / 'good'}", "clients=1"])
    main(["certs", f"out={tmp_path / 'other'}", "clients=1"])
    (tmp_path / "good" / swap).write_bytes((tmp_path / "other" / swap).read_bytes())
    return str(tmp_path / "good")


@pytest.mark.parametrize(
    ("command", "swap", "message"),
    [
        ("client", "client-0.key", "client-0.key' is not the key of"),
        ("client", "ca.pem", "client-0.pem' was not signed by the CA in"),
        ("server", "ca.pem", "server.pem' was not signed by the CA in"),
        ("server", "server.key", "server.key' is not the key of"),
        ("server", "server.pem", "server.key' is not the key of"),
    ],
)
def test_mismatched_credentials_are_refused_at_start_naming_the_file(tmp_path, capsys, command, swap, message):
    certs = _mixed_certs(tmp_path, swap)
    keys = ["connect=127.0.0.1:1"] if command == "client" else ["listen=127.0.0.1:1", "dataset=synthetic"]
    assert main([command, f"certs={certs}", *keys, f"out={tmp_path / 'run'}"][: 3 if command == "client" else 5]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_an_expired_or_unreadable_certificate_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from splitlab.net import certs

    monkeypatch.setattr(certs, "VALID_DAYS", 0)  # valid until the moment it is made
    main(["certs", f"out={tmp_path}", "clients=1"])
    assert main(["client", "connect=127.0.0.1:1", f"certs={tmp_path}"]) == 2
    assert "is valid from" in capsys.readouterr().err
    (tmp_path / "client-0.key").write_text("garbage")
    assert main(["client", "connect=127.0.0.1:1", f"certs={tmp_path}"]) == 2
    assert "client-0.key' is not an unencrypted PEM private key" in capsys.readouterr().err
