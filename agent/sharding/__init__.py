"""sdcguard for a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): pure FSDP over
a 1-D mesh, HSDP over a 2-D ``(replicate, shard)`` mesh (docs/design.md §3, "Sharded models").

``layout`` says where each rank sits (its replica and its shard) and which checks the mesh allows;
``reduce_record`` is FSDP2's reduce-scatter and all-reduce hook that record each rank's local
gradient before it is reduced (checks 1 and 4); ``reduction_check`` turns those records into the
step's vote and judges it; ``shard_weights`` is check 3 per shard across its replicas;
``sdcguard.layouts.fsdp`` hands them to the checks. Each judgement is a pure function.
"""
