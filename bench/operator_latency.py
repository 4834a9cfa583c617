"""Benchmark: alarm Event -> suspect node cordoned, through the real operator.

The operator (``sdcguard operator``, a subprocess) runs against the Kubernetes emulator and the
local SageMaker endpoint of the tests.  Alarms are posted one at a time (each names a new node of a
new job step); a watch on nodes timestamps the cordon.  Meanwhile flood threads post unrelated
Events into the same namespace.  The emulator applies the operator's field selector
(reason=SilentDataCorruption) as a real API server does, so the flood never reaches the operator.

    .venv/bin/python bench/operator_latency.py --alarms 200 --flood-rate 200 --flood-threads 4

Prints p50/p90/p99/max latency, the achieved flood rate and the emulator's own cost of one GET
(everything shares one 2-core machine: the emulator, the flood, the watch and the operator).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import kubernetes  # noqa: E402
from conftest import OperatorWorld, make_alarm, new_instance  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alarms", type=int, default=100)
    parser.add_argument("--flood-threads", type=int, default=2)
    parser.add_argument("--flood-rate", type=float, default=50.0, help="unrelated Events per second, all threads")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between a cordon and the next alarm")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the operator
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="sdcguard-bench-"))
    world = OperatorWorld(workdir, SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES="100000", SDCGUARD_DEEP_HEALTH_CHECKS="",
                          SDCGUARD_POLL_SECONDS="30")
    ns = "bench"
    ids = [new_instance() for _ in range(args.alarms + 1)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(ns, "llm", nodes)

    cordoned_at: dict[str, float] = {}
    seen = threading.Condition()

    def watch_nodes() -> None:
        core = kubernetes.client.CoreV1Api(world.kube.api_client())
        for event in kubernetes.watch.Watch().stream(core.list_node):
            node = event["object"]
            if node.spec and node.spec.unschedulable and node.metadata.name not in cordoned_at:
                with seen:
                    cordoned_at[node.metadata.name] = time.monotonic()
                    seen.notify_all()

    stop = threading.Event()
    flooded = [0] * args.flood_threads

    def flood(index: int) -> None:
        core = kubernetes.client.CoreV1Api(world.kube.api_client())
        period = args.flood_threads / args.flood_rate
        while not stop.is_set():
            started = time.monotonic()
            try:
                core.create_namespaced_event(ns, {
                    "metadata": {"generateName": "noise-"}, "type": "Normal", "reason": "Pulled",
                    "message": "Container image already present on machine",
                    "involvedObject": {"kind": "Pod", "name": f"other-{flooded[index] % 50}", "namespace": ns}})
                flooded[index] += 1
            except kubernetes.client.ApiException:
                pass
            time.sleep(max(0.0, period - (time.monotonic() - started)))

    threading.Thread(target=watch_nodes, daemon=True).start()
    probe = kubernetes.client.CoreV1Api(world.kube.api_client())
    started = time.monotonic()
    for _ in range(20):
        probe.read_node(nodes[0])
    emulator_ms = round((time.monotonic() - started) / 20 * 1000, 1)  # the emulator's own cost per request
    world.start_operator()
    # Warm-up: the first alarm pays for the operator's start-up and first watches.
    latencies: list[float] = []
    floods = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(args.flood_threads)]
    try:
        for i in range(args.alarms + 1):
            if i == 1:
                for thread in floods:
                    thread.start()
                flood_start, flood_base = time.monotonic(), sum(flooded)
            record = make_alarm(ns, "llm", step=1000 + i, suspects=[(i, pods[i], nodes[i])],
                                reporter=(i, pods[i], nodes[i]))
            sent = time.monotonic()
            world.alarm_event(ns, record)
            with seen:
                if not seen.wait_for(lambda: nodes[i] in cordoned_at, timeout=120):
                    raise SystemExit(f"alarm {i}: node never cordoned\n{world.log()[-3000:]}")
            if i > 0:
                latencies.append(cordoned_at[nodes[i]] - sent)
            time.sleep(args.gap)
        flood_rate = (sum(flooded) - flood_base) / (time.monotonic() - flood_start)
    finally:
        stop.set()
        world.close()

    result = {
        "alarms": len(latencies), "emulator_read_ms": emulator_ms, "flood_events": sum(flooded), "flood_events_per_s": round(flood_rate, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 1), "p90_ms": round(1000 * percentile(latencies, 90), 1),
        "p99_ms": round(1000 * percentile(latencies, 99), 1), "max_ms": round(1000 * max(latencies), 1),
        "mean_ms": round(1000 * statistics.fmean(latencies), 1), "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
