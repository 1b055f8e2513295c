"""Throw-away TLS material for tests: a CA and one certificate for 127.0.0.1."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certs(directory: Path) -> dict[str, str]:
    """Create ``ca.crt``, ``node.crt`` and ``node.key`` in ``directory`` with openssl.

    The node certificate is valid for 127.0.0.1 and localhost, for both server and
    client authentication. Returns the paths by file name.
    """

    def openssl(*args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60
        )

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
            "-out", "ca.crt", "-days", "2", "-subj", "/CN=etcd-rendezvous test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key",
            "-out", "node.csr", "-subj", "/CN=127.0.0.1")  # fmt: skip
    (directory / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "node.crt", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip
    return {name: str(directory / name) for name in ("ca.crt", "node.crt", "node.key")}
