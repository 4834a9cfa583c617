"""sdcguard's kopf operator: alarm Events -> incidents -> containment -> approval -> node replacement.

Run with ``kopf run -m sdcguard_operator`` or ``sdcguard operator``. Importing the package registers
every handler and webhook into kopf's default registry (:mod:`.main`), with the settings read once:
a bad setting exits with status 2 and one line, before anything starts.
"""
from .main import register_default as _register_default

_register_default()
