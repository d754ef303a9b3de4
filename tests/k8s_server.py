"""A stand-in for a Kubernetes API server on loopback: HTTPS with a self-signed certificate for
127.0.0.1, serving RayCluster objects at the path the API serves them
(``/apis/ray.io/v1/namespaces/<ns>/rayclusters/<name>``), a Kubernetes ``Status`` 404 for anything
else. What a KubeRay head pod finds through KUBERNETES_SERVICE_HOST / _PORT_HTTPS."""

from __future__ import annotations

import contextlib
import datetime
import http.server
import ipaddress
import json
import ssl
import threading
from pathlib import Path


def self_signed(out: Path) -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1, the certificate its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = out / "apiserver.crt", out / "apiserver.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@contextlib.contextmanager
def api_server(objects: dict[str, dict], workdir: Path):
    """Serve ``objects`` ({API path: object}) over HTTPS; yields (env for a pod, requests seen)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            seen.append(self.path)
            obj = objects.get(self.path)
            body = obj or {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
            self.send_response(200 if obj else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args):  # quiet
            pass

    cert, key = self_signed(workdir)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT_HTTPS": str(server.server_address[1]),
        # Ray's KubeRay client trusts this CA and, with no service-account token projected (not in a
        # pod), authenticates with this client certificate (its RAY_KUBERAY_CLIENT_* variables).
        "RAY_KUBERAY_CA_CERT_PATH": str(cert),
        "RAY_KUBERAY_CLIENT_CERT_PATH": str(cert),
        "RAY_KUBERAY_CLIENT_KEY_PATH": str(key),
    }
    try:
        yield env, seen
    finally:
        server.shutdown()
        server.server_close()
