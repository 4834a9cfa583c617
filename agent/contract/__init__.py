"""The torch-free contract between the in-pod library, the sidecar and the operator.

The alarm schema, the Event that carries it, the spool both sides of a pod share, the statistics
file, and every name the agent and the operator must spell alike (``names``). Nothing here imports
torch or a Kubernetes client: the sidecar and the operator import it as it is.
"""
