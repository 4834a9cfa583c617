"""``sdcguard drill``: the product's own fault-injection release test (docs/design.md §3).

``launch`` parses and checks the arguments and starts one ``worker`` process per rank; the workers
train ``model`` under the library with faults injected; ``report`` judges the alarms.
"""
