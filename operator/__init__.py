"""sdcguard's kopf operator: alarm Events -> incidents -> containment -> approval -> node replacement.

Run with ``kopf run -m sdcguard_operator`` or ``sdcguard operator``.  Importing the package
registers the handlers (``handlers``), the pod mutating webhook (``webhook``) and the
NodeReplacement admission webhook (``admission``).
"""
from . import handlers  # noqa: F401
from . import webhook  # noqa: F401
from . import admission  # noqa: F401
