"""The torch-free contract between the in-pod library, the sidecar and the operator.

The alarm schema (``alarm``: the wire record and its typed view), the Event that carries it, the
spool both sides of a pod share, the statistics file, every name the agent and the operator must
spell alike (``names``), and the phases and decisions of the operator's objects (``phases``).
Standard library only (tests/test_contract.py): the sidecar, the operator and the kubectl plugin
import it as it is, and it is all the operator imports of the library.
"""
