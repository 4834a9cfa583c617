"""The contract the library, the sidecar and the operator share (``agent/contract/``), and who
may import what: the operator takes only ``sdcguard.contract`` from the library, the contract
needs only the standard library, and the kubectl plugin nothing beyond both (no kopf, boto3,
Kubernetes client or torch: ``pip install sdcguard`` is enough for ``kubectl sdcguard``). The
phases and decisions are the ones the CRDs enumerate; the annotation settings the ones the
library reads.

In-process (``ast``, the CRD files) and one short subprocess per plugin run; no cluster.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPERATOR = ROOT / "operator"
CONTRACT = ROOT / "agent" / "contract"

BLOCKED = ("kopf", "boto3", "botocore", "kubernetes", "torch", "numpy", "prometheus_client")

# Run the plugin with a meta-path finder that makes every import of a BLOCKED package fail, as on
# a laptop where only `pip install sdcguard` was done.
PLUGIN = textwrap.dedent("""
    import json, sys
    BLOCKED = set(json.loads(sys.argv[1]))

    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, Missing())
    from sdcguard_operator import kubectl_plugin
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    sys.exit(kubectl_plugin.main(sys.argv[2:]))
""")


def _plugin(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PLUGIN, json.dumps(BLOCKED), *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1", **env})


def test_the_kubectl_plugin_runs_without_kopf_boto3_kubernetes_or_torch(tmp_path: pathlib.Path) -> None:
    helped = _plugin("--help")
    assert helped.returncode == 0, helped.stderr
    assert "approve" in helped.stdout and "incidents" in helped.stdout
    # Against nothing: a kubeconfig whose API server does not answer; the real kubectl fails, the
    # plugin says so on one line and exits 1 (no traceback).
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "nowhere",
        "clusters": [{"name": "nowhere", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "nobody", "user": {"token": "x"}}],
        "contexts": [{"name": "nowhere", "context": {"cluster": "nowhere", "user": "nobody"}}]}))
    kubectl = ROOT / ".venv" / "bin" / "kubectl"
    listed = _plugin("incidents", KUBECONFIG=str(kubeconfig),
                     KUBECTL=str(kubectl) if kubectl.exists() else "kubectl")
    assert listed.returncode == 1, listed.stderr
    assert listed.stderr.startswith("kubectl sdcguard: error:") and "Traceback" not in listed.stderr, listed.stderr
    missing = _plugin("history", KUBECTL=str(tmp_path / "no-kubectl"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr, missing.stderr
    assert "cannot run" in missing.stderr and "$KUBECTL" in missing.stderr


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path`` (relative ones resolved inside the package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_the_operator_imports_only_the_contract_from_the_library() -> None:
    """docs/design.md §10: the operator imports only ``sdcguard.contract``; anything else of the
    library (its config, its checks) would drag the agent's code, and torch, into the operator."""
    offending = [f"{path.relative_to(ROOT)}:{line}: {module}" for path in sorted(OPERATOR.glob("**/*.py"))
                 for line, module in _imports(path)
                 if (module == "sdcguard" or module.startswith("sdcguard.")) and not (
                     module == "sdcguard.contract" or module.startswith("sdcguard.contract."))]
    assert not offending, "\n".join(offending)


def test_the_contract_needs_nothing_beyond_the_standard_library() -> None:
    """What the library, the sidecar and the operator share imports only the standard library and
    itself (relative imports)."""
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    offending = [f"{path.relative_to(ROOT)}:{line}: {module}" for path in sorted(CONTRACT.glob("*.py"))
                 for line, module in _imports(path) if module.split(".")[0] not in allowed]
    assert not offending, "\n".join(offending)


def test_the_annotation_settings_are_the_ones_the_library_reads() -> None:
    """The webhook's annotation -> variable mapping (``names.ANNOTATION_SETTINGS``) is what
    ``sdcguard.Config.from_env`` reads, with the defaults the webhook names in its warnings."""
    from sdcguard.config import Config
    from sdcguard.contract import names

    assert list(names.ANNOTATION_SETTINGS) == [names.AUDIT_EVERY_ANNOTATION, names.WEIGHT_CHECK_EVERY_ANNOTATION]
    config = Config.from_env({var: str(default + 7) for var, default in names.ANNOTATION_SETTINGS.values()})
    assert (config.audit_every, config.weight_check_every) == tuple(
        default + 7 for _, default in names.ANNOTATION_SETTINGS.values())
    assert (Config().audit_every, Config().weight_check_every) == tuple(
        default for _, default in names.ANNOTATION_SETTINGS.values())


def _crd_enum(crd: str, *path: str) -> list[str]:
    schema = yaml.safe_load((ROOT / "deploy" / "crds" / crd).read_text())["spec"]["versions"][0]["schema"]
    node = schema["openAPIV3Schema"]
    for key in path:
        node = node["properties"][key]
    return node["enum"]


def test_the_phases_and_decisions_are_the_ones_the_crds_allow() -> None:
    from sdcguard.contract import phases

    assert sorted(phases.ReplacementPhase) == sorted(_crd_enum("nodereplacement.yaml", "status", "phase"))
    assert sorted(phases.IncidentPhase) == sorted(_crd_enum("sdcincident.yaml", "status", "phase"))
    assert sorted(phases.Decision) == sorted(d for d in _crd_enum("nodereplacement.yaml", "spec", "decision") if d)
    assert phases.ReplacementPhase.FAILED == "Failed" and f"{phases.Decision.APPROVED}" == "Approved"
    assert json.dumps({"phase": phases.IncidentPhase.RESOLVED}) == '{"phase": "Resolved"}'
