"""HTTPS (vLLM's --ssl-* flags): the files checked before anything starts, a real server answering over TLS (and not
over plain HTTP), and --enable-ssl-refresh serving a renewed certificate to new connections without a restart."""

from __future__ import annotations

import asyncio
import datetime
import os
import ssl
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess
from tpserve.launch import tls
from tpserve.launch.args import parse_args
from tpserve.launch.tls import TLSFiles


def make_cert(directory: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1 and its key (PEM files ``name``.crt / .key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tpserve test {name}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def served_certificate(context: ssl.SSLContext) -> bytes:
    """The certificate (DER) a handshake with ``context`` as the server presents, in memory."""
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client_side = client.wrap_bio(c_in, c_out, server_hostname="localhost")
    server_side = context.wrap_bio(s_in, s_out, server_side=True)
    done: set[int] = set()
    for _ in range(10):
        for index, side in enumerate((client_side, server_side)):
            try:
                side.do_handshake()
                done.add(index)
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done == {0, 1}:
            return client_side.getpeercert(binary_form=True)
    raise AssertionError("no handshake")


def der(cert_file: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(cert_file).read_text())


def test_bad_tls_files_and_flags_are_usage_errors(qwen3_dir, tmp_path, capsys):
    cert, key = make_cert(tmp_path, "a")
    _, other_key = make_cert(tmp_path, "b")
    cases = [
        (["--ssl-certfile", str(tmp_path / "none.crt")], f"--ssl-certfile {tmp_path / 'none.crt'}: no such file"),
        (["--ssl-certfile", cert, "--ssl-keyfile", other_key], "cannot serve TLS with them"),
        (["--ssl-certfile", cert], "cannot serve TLS with them"),  # no key in the certificate's file
        (["--ssl-keyfile", key], "--ssl-keyfile needs --ssl-certfile"),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh without --ssl-certfile: HTTPS is off"),
        (["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
        (["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "3"], "invalid choice: 3"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            parse_args(["--model", qwen3_dir, *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    args = parse_args(["--model", qwen3_dir, "--ssl-certfile", cert, "--ssl-keyfile", key, "--enable-ssl-refresh"])
    assert args.tls == TLSFiles(cert, key) and args.enable_ssl_refresh
    assert parse_args(["--model", qwen3_dir]).tls is None


def test_refresh_serves_the_renewed_certificate(tmp_path, monkeypatch):
    from uvicorn.config import create_ssl_context

    monkeypatch.setattr(tls, "REFRESH_POLL_S", 0.02)
    cert, key = make_cert(tmp_path, "live")
    first = der(cert)
    files = TLSFiles(cert, key)
    context = create_ssl_context(cert, key, None, ssl.PROTOCOL_TLS_SERVER, ssl.CERT_NONE, None, "TLSv1")

    async def renew_while_refreshing() -> list[bytes]:
        stop = asyncio.Event()
        task = asyncio.create_task(files.refresh(context, stop))
        seen = [served_certificate(context)]
        await asyncio.sleep(0.1)
        Path(cert).write_text("half-written")  # a renewal caught mid-write: the context keeps the old files
        os.utime(cert, ns=(1, 1))
        await asyncio.sleep(0.1)
        seen.append(served_certificate(context))
        renewed, renewed_key = make_cert(tmp_path, "renewed")
        os.replace(renewed_key, key)
        os.replace(renewed, cert)
        for _ in range(100):
            await asyncio.sleep(0.02)
            if served_certificate(context) != first:
                break
        seen.append(served_certificate(context))
        stop.set()
        await task
        return seen

    before, mid_write, after = asyncio.run(renew_while_refreshing())
    assert before == mid_write == first and after == der(cert) != first


def test_a_server_answers_over_https_only_to_clients_with_a_certificate(tmp_path):
    """--ssl-cert-reqs 2: a client without a certificate its CA signed gets no answer."""
    cert, key = make_cert(tmp_path, "server")
    client_cert, client_key = make_cert(tmp_path, "client")
    trusted = ssl.create_default_context(cafile=cert)
    trusted.load_cert_chain(client_cert, client_key)
    flags = ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", client_cert, "--ssl-cert-reqs", "2"]
    with ServerProcess(flags, fake_scheduler=True) as srv:
        url = srv.wait_url()
        assert url.startswith("https://127.0.0.1:"), url
        srv.wait_ready(verify=trusted)
        assert httpx.get(f"{url}/health", verify=trusted, timeout=10).status_code == 200
        models = httpx.get(f"{url}/v1/models", verify=trusted, timeout=10).json()["data"]
        assert models and models[0]["object"] == "model"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url.replace('https://', 'http://')}/health", timeout=10)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health", timeout=10)  # not a certificate the client trusts
        with pytest.raises(httpx.HTTPError):  # no client certificate
            httpx.get(f"{url}/health", verify=ssl.create_default_context(cafile=cert), timeout=10)
