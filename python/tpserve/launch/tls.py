"""HTTPS, as vLLM serves it: uvicorn's TLS from --ssl-keyfile/--ssl-certfile (client certificates with --ssl-ca-certs
and --ssl-cert-reqs), and with --enable-ssl-refresh the files re-read into the live context when they change (a
renewed certificate is served to new connections without a restart, as vLLM's SSLCertRefresher does)."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

REFRESH_POLL_S = 1.0  # how often --enable-ssl-refresh looks at the files' modification times


@dataclass(frozen=True)
class TLSFiles:
    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE
    ciphers: str | None = None

    def uvicorn_options(self) -> dict[str, Any]:
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": self.cert_reqs, "ssl_ciphers": self.ciphers or "TLSv1"}

    def check(self) -> None:
        """Build the context once, as uvicorn will: a ValueError names the flag and the file that cannot be used
        (before any process is started)."""
        for flag, path in (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
                           ("--ssl-ca-certs", self.ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        if self.cert_reqs == ssl.CERT_REQUIRED and self.ca_certs is None:
            raise ValueError("--ssl-cert-reqs 2 (client certificates required) needs --ssl-ca-certs, the CA file "
                             "that signed them")
        from uvicorn.config import create_ssl_context

        options = self.uvicorn_options()
        try:
            create_ssl_context(self.certfile, self.keyfile, None, ssl.PROTOCOL_TLS_SERVER, self.cert_reqs,
                               self.ca_certs, options["ssl_ciphers"])
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ValueError(f"--ssl-certfile {self.certfile}"
                             f"{f' / --ssl-keyfile {self.keyfile}' if self.keyfile else ''}: cannot serve TLS with "
                             f"them: {e}") from None

    def _mtimes(self) -> tuple[int | None, ...]:
        return tuple(_mtime(path) for path in (self.certfile, self.keyfile, self.ca_certs))

    async def refresh(self, context: ssl.SSLContext, stop: asyncio.Event) -> None:
        """Until ``stop``: re-read the certificate chain (and the CA file) into ``context`` when a file changes; a
        file caught half-written is tried again at the next change, the context keeping what it had."""
        seen = self._mtimes()
        while not stop.is_set():
            await asyncio.sleep(REFRESH_POLL_S)
            now = self._mtimes()
            if now == seen:
                continue
            seen = now
            try:
                context.load_cert_chain(self.certfile, self.keyfile)
                if self.ca_certs is not None:
                    context.load_verify_locations(self.ca_certs)
            except (ssl.SSLError, OSError) as e:
                logger.warning("TLS files changed but cannot be loaded (%s): still serving the previous ones", e)
                continue
            logger.info("TLS certificate reloaded from %s", self.certfile)


def _mtime(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None
