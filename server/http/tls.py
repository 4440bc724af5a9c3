"""TLS for the HTTP front: one `ssl.SSLContext` built from vLLM's flags, and its reload.

Why this module exists: keys and prompts cross a team's network, so the front
speaks HTTPS on aiohttp's own server (`TCPSite(ssl_context=...)`), HTTP/1.1
keep-alive and streaming unchanged. The certificate is checked when the
flags are parsed (server/cli.py), before any engine starts, so a bad path or
a key that does not match is one `sluice serve: error:` line and exit 2; the
same `server_context` builds the context `serve()` listens with.

Mutual TLS: `--ssl-ca-certs` names the CA bundle client certificates are
checked against and `--ssl-cert-reqs` (vLLM's numbers, 0 none, 1 optional,
2 required, or those names) whether a client must show one.

Reload (SIGHUP, beside the callers file): `reload` loads the new certificate,
key and CA bundle into the *live* context. OpenSSL copies a context's
certificate into each connection at its handshake, so a connection already
open keeps the certificate it began with (a stream in progress finishes) and
every new one gets the new certificate; nothing is dropped, no socket is
rebound. A reload that fails (a half-written file) keeps the old certificate
and logs why. The CA bundle is added to, not replaced (OpenSSL has no way to
remove a CA from a live context): to revoke a client CA, restart.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

from server.settings import TlsConfig

__all__ = ["CERT_REQS", "TlsConfig", "cert_reqs", "reload", "server_context"]

log = logging.getLogger("sluice")

# --ssl-cert-reqs: vLLM's numbers (the ssl module's VerifyMode) or their names.
CERT_REQS = {
    "0": ssl.CERT_NONE,
    "none": ssl.CERT_NONE,
    "1": ssl.CERT_OPTIONAL,
    "optional": ssl.CERT_OPTIONAL,
    "2": ssl.CERT_REQUIRED,
    "required": ssl.CERT_REQUIRED,
}


def cert_reqs(value: str) -> ssl.VerifyMode:
    """--ssl-cert-reqs' value; ValueError naming the choices."""
    try:
        return CERT_REQS[value.strip().lower()]
    except KeyError:
        raise ValueError(
            f"--ssl-cert-reqs must be 0, 1, 2 or none, optional, required; got {value!r}"
        ) from None


def server_context(cfg: TlsConfig) -> ssl.SSLContext:
    """A server context for `cfg`; ValueError with one line if a file is missing,
    unreadable or not a matching certificate and key."""
    if cfg.cert_reqs is not ssl.CERT_NONE and cfg.ca_certs is None:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the clients' CA)")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cfg.ciphers:
        try:
            ctx.set_ciphers(cfg.ciphers)
        except ssl.SSLError as exc:
            raise ValueError(f"--ssl-ciphers {cfg.ciphers!r}: {_why(exc)}") from None
    _load(ctx, cfg)
    ctx.verify_mode = cfg.cert_reqs
    return ctx


async def reload(ctx: ssl.SSLContext, cfg: TlsConfig) -> bool:
    """SIGHUP: load `cfg`'s files again into the live `ctx` (new connections get
    them). Checked first on a scratch context on a thread (all or nothing: a
    failure keeps the old certificate and logs why); then loaded into the live
    context on the loop, whose handshakes read it (an OpenSSL context is not
    changed from another thread while in use; the files are a few KB)."""
    try:
        await asyncio.to_thread(server_context, cfg)
        _load(ctx, cfg)
    except ValueError as exc:
        log.error(
            "TLS reload failed; keeping the old certificate", extra={"fields": {"why": str(exc)}}
        )
        return False
    log.info("TLS certificate reloaded", extra={"fields": {"certfile": str(cfg.certfile)}})
    return True


def _load(ctx: ssl.SSLContext, cfg: TlsConfig) -> None:
    for flag, path in (
        ("--ssl-certfile", cfg.certfile),
        ("--ssl-keyfile", cfg.keyfile),
        ("--ssl-ca-certs", cfg.ca_certs),
    ):
        if path is not None and not path.is_file():
            raise ValueError(f"{flag}: no such file: {path}")
    try:
        ctx.load_cert_chain(cfg.certfile, cfg.keyfile)
    except (OSError, ssl.SSLError) as exc:
        names = f"{cfg.certfile}" + (f", {cfg.keyfile}" if cfg.keyfile else "")
        raise ValueError(
            f"--ssl-certfile/--ssl-keyfile ({names}): not a readable certificate and "
            f"matching private key in PEM: {_why(exc)}"
        ) from None
    if cfg.ca_certs is not None:
        try:
            ctx.load_verify_locations(cafile=cfg.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"--ssl-ca-certs {cfg.ca_certs}: not a readable PEM CA bundle: {_why(exc)}"
            ) from None


def _why(exc: OSError | ssl.SSLError) -> str:
    """OpenSSL's reason in one line ([SSL] PEM lib ...)."""
    return " ".join(str(getattr(exc, "strerror", None) or exc).split())
