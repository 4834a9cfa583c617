"""A local stand-in HyperPod-on-EKS cluster, for trying sdcguard and for its tests.

A SANDBOX, never a production path. ``sdcguard sandbox`` serves it until interrupted;
``sdcguard demo`` (``make demo``) runs the whole loop in it once. Installed by the
``sdcguard[sandbox]`` extra.

- :mod:`.kube`: a Kubernetes API emulator on 127.0.0.1 (kmock, adapted server-side: resourceVersion
  and 409s, authentication by token, SubjectAccessReview, admission webhooks, fault injection).
- :mod:`.sagemaker`: a SageMaker endpoint (moto, plus the HyperPod node calls: deep health checks,
  node replacement, scripted outcomes and random faults).
- :mod:`.cluster`: both, HyperPod-like nodes, jobs and pods, and the real operator as a subprocess.
- :mod:`.serve`: ``sdcguard sandbox``; :mod:`.demo`: ``sdcguard demo``.
"""
