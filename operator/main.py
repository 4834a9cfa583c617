"""The one module that registers sdcguard's kopf handlers and webhooks, with the settings read once.

``kopf run -m sdcguard_operator`` imports the package, which calls :func:`register_default`: the
settings are read there, once, and a bad one is a single line on stderr and exit status 2, before
kopf starts. ``sdcguard operator`` (:mod:`.cli`) reads them the same way, with its flags over the
environment, and registers into registries of its own (handlers only while it leads).
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

import kopf

from . import admission, handlers, pod_mutation, webhook
from .settings import Settings


class BadSettings(SystemExit):
    """A setting that cannot be used: said on one line, exit status 2."""


def load_settings(env: Mapping[str, str] | None = None, *, prog: str = "sdcguard operator") -> Settings:
    """The operator's settings and the pod webhook's sidecar settings, checked; exit 2 on a bad one."""
    env = os.environ if env is None else env
    try:
        settings = Settings.from_env(env)
        pod_mutation.SidecarSettings.from_env(env)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise BadSettings(2) from None
    return settings


def register(registry: kopf.OperatorRegistry, settings: Settings, *, handlers_too: bool = True,
             webhooks_too: bool = True, with_login: bool = True) -> None:
    """Every kopf handler sdcguard has: the handlers (alarm intake, incidents, replacements, keys)
    and the webhooks (pod mutation, NodeReplacement admission)."""
    if handlers_too:
        handlers.register(registry, settings, with_login=with_login)
    elif with_login:
        kopf.on.login(registry=registry, id="sdcguard-login")(handlers.login)
    if webhooks_too:
        webhook.register(registry)
        admission.register(registry, settings)


def register_default() -> None:
    """For ``kopf run -m sdcguard_operator``: everything into kopf's default registry."""
    register(kopf.get_default_registry(), load_settings(prog="sdcguard_operator"))
