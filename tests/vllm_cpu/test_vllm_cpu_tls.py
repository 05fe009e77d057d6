"""A vLLM server that speaks HTTPS (serve.ssl_keyfile / ssl_certfile): captured, restored, its
health checked over TLS by the restore, a completion over HTTPS verified against the server's own
certificate. uvicorn reads the TLS files after every restore: a renewed certificate is served, and
a key that is no longer root's alone is refused before anything runs."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import engine_processes
from tests.vllm_cpu.conftest import VllmImage, capture_tiny, kill_leftovers, run_vsnap

pytestmark = pytest.mark.criu


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1 in ``directory`` (made root's alone if new: the rules
    require it of what the root engine reads); a second call renews them in place."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vsnap-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    directory.mkdir(mode=0o700, exist_ok=True)
    key_file, cert_file = directory / "key.pem", directory / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    for path in (key_file, cert_file):
        path.chmod(0o600)
    return key_file, cert_file


@pytest.fixture(scope="module")
def tls_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmImage, Path, Path]]:
    base = tmp_path_factory.mktemp("vllm-cpu-tls")
    key, cert = self_signed(base / "tls")
    image = capture_tiny(base, "vllm-tls", (f"  ssl_keyfile: {key}", f"  ssl_certfile: {cert}"))
    yield image, key, cert
    kill_leftovers(image)


def complete_over_https(image: VllmImage, cert: Path) -> None:
    """Restore, then one completion over HTTPS from a client that checks the server's certificate
    against ``cert``; plain HTTP to the same port gets no answer."""
    restored = run_vsnap("restore", str(image.image), "--port", "0", "--detach", "--json")
    assert restored.returncode == 0, restored.stderr[-3000:]
    server = json.loads(restored.stdout)
    try:
        assert server["url"] == f"https://127.0.0.1:{server['port']}"
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"{server['url']}/v1/models", timeout=60, context=context) as response:
            model = json.loads(response.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}).encode()
        request = urllib.request.Request(f"{server['url']}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120, context=context) as response:
            answer = json.loads(response.read())
        assert answer["choices"] and answer["usage"]["completion_tokens"] == 2
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # it speaks nothing but TLS
            urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/health", timeout=30)
    finally:
        stopped = run_vsnap("stop", server["instance"], "--json")
    assert stopped.returncode == 0, stopped.stderr


def test_a_tls_server_is_restored_and_answers_over_https(tls_image: tuple[VllmImage, Path, Path]) -> None:
    image, key, cert = tls_image
    assert not {str(key), str(cert)} & {d.path for d in image.manifest.dependencies}  # renewable: no sha256
    complete_over_https(image, cert)


def test_a_renewed_certificate_is_what_the_restored_server_serves(tls_image: tuple[VllmImage, Path, Path]) -> None:
    image, key, cert = tls_image
    self_signed(key.parent)  # a new key and certificate at the same paths
    complete_over_https(image, cert)  # checked against the new certificate: the old one would fail


def test_a_key_no_longer_roots_alone_is_refused_before_anything_runs(tls_image: tuple[VllmImage, Path, Path]) -> None:
    image, key, _ = tls_image
    os.chown(key, 65534, 65534)
    try:
        refused = run_vsnap("restore", str(image.image), "--port", "0", "--detach", "--json")
        output = refused.stdout + refused.stderr
        assert refused.returncode == 4, output[-3000:]
        assert "the serve.ssl_keyfile is owned by uid 65534" in output
        assert engine_processes(image.control_dir) == []
    finally:
        os.chown(key, 0, 0)
