"""sdcguard's kopf operator: alarm Events -> incidents -> containment -> approval -> node replacement.

Run it with ``sdcguard operator`` (leader election, the chart's command) or
``kopf run -m sdcguard_operator.main``. Importing this package, or any module of it, registers no
kopf handler and reads no setting: :mod:`.main` is the one module that registers handlers, and it
reads the settings when the operator starts. The kubectl plugin (:mod:`.kubectl_plugin`) needs
neither kopf nor boto3.
"""
