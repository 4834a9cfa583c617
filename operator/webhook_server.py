"""The one HTTPS server kopf serves the admission webhooks from (pod mutation, NodeReplacement
admission), as the chart configures it."""
from __future__ import annotations

import logging
import os
from typing import Mapping

import kopf

log = logging.getLogger("sdcguard_operator.webhook")


def server_from_env(env: Mapping[str, str]) -> kopf.WebhookServer:
    """HTTPS with the chart's certificate (``SDCGUARD_WEBHOOK_CERT_DIR``/tls.crt, tls.key; kopf
    reloads it when cert-manager renews it); without one, plain HTTP on localhost for development
    (the API server cannot call it, so pods are admitted unchanged — failurePolicy Ignore)."""
    port = int(env.get("SDCGUARD_WEBHOOK_PORT") or 9443)
    cert_dir = env.get("SDCGUARD_WEBHOOK_CERT_DIR")
    if cert_dir:
        return kopf.WebhookServer(addr=env.get("SDCGUARD_WEBHOOK_ADDR") or "0.0.0.0", port=port,
                                  certfile=os.path.join(cert_dir, "tls.crt"),
                                  pkeyfile=os.path.join(cert_dir, "tls.key"))
    log.warning("sdcguard webhook: SDCGUARD_WEBHOOK_CERT_DIR is not set; serving plain HTTP on 127.0.0.1 "
                "(development only: the API server cannot call it)")
    return kopf.WebhookServer(addr="127.0.0.1", port=int(env["SDCGUARD_WEBHOOK_PORT"]) if env.get(
        "SDCGUARD_WEBHOOK_PORT") else None, insecure=True)
