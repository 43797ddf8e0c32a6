"""``nanoserve gateway``: the OpenAI API in front of several replicas, as processes on this machine.

    nanoserve gateway [--replicas N] [--port 8000] [--policy cache_aware] [--event-log-url URL] [-- SERVE FLAGS]

Starts N ``nanoserve serve`` replicas (pool ids ``replica-0`` ...) and the
Shepherd Model Gateway in front of them (``smg launch --backend vllm
--worker-urls grpc://... --policy ...``), prints one JSON line describing them
(``gateway_ready``: the OpenAI base URL, each replica's address, pool id,
Prometheus port and pid), and runs until SIGTERM or SIGINT, when it stops the gateway, then the
replicas (streams drain for ``--grace-s``, epochs close). A replica that exits
on its own is reported (``process_exited``) and the gateway routes around it;
when the gateway or every replica has exited, the rest is stopped. Each
replica gets its own Prometheus port (free ports unless
``--replica-metrics-ports`` names them; ``-- --metrics-port off`` turns them
off). Exit 0 after a clean stop; 1 when a process failed to start (the error
names it and quotes its last lines of output), exited on its own or stopped
with a failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from nanoserve.allocator.log import DEFAULT_EVENT_LOG_URL

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def register(subparsers: Any) -> None:
    from nanoserve.service.gateway.replicas import POLICIES

    parser = subparsers.add_parser(
        "gateway",
        help="serve the OpenAI API through smg in front of several replicas (processes on this machine)",
        description=(
            "Start N nanoserve replicas and the Shepherd Model Gateway (smg, `pip install 'nanoserve[gateway]'`) in "
            "front of them: the OpenAI chat/completions API on --host:--port, routed across the replicas by "
            "--policy. Flags after `--` go to every replica's `nanoserve serve`. Runs until SIGTERM/SIGINT."
        ),
    )
    parser.add_argument("--replicas", type=int, default=2, metavar="N", help="number of replicas (default 2)")
    parser.add_argument("--host", default="127.0.0.1", help="where the gateway listens (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port (default 8000; 0: any free)")
    parser.add_argument(
        "--replica-ports",
        default=None,
        metavar="P0,P1,...",
        help="each replica's gRPC port on 127.0.0.1 (default: free ports)",
    )
    parser.add_argument(
        "--replica-metrics-ports",
        default=None,
        metavar="P0,P1,...",
        help="each replica's Prometheus port (default: free ports; `-- --metrics-port off` turns them off)",
    )
    parser.add_argument(
        "--prometheus-port", type=int, default=29000, help="the gateway's /metrics port (default 29000; 0: any free)"
    )
    parser.add_argument(
        "--prometheus-host",
        default="127.0.0.1",
        help="where the gateway's /metrics listens (default 127.0.0.1: it answers without a key; 0.0.0.0 for "
        "a scraper on another machine)",
    )
    parser.add_argument(
        "--policy", choices=POLICIES, default="cache_aware", help="smg routing policy (default cache_aware)"
    )
    parser.add_argument(
        "--pool-id-prefix", default="replica", help="replica i logs under pool id PREFIX-i (default: replica)"
    )
    parser.add_argument(
        "--event-log-url",
        default=os.environ.get("NANOSERVE_EVENT_LOG_URL", DEFAULT_EVENT_LOG_URL),
        help="the event log every replica writes, each under its own pool id (postgresql+psycopg://... for "
        f"production; none: no log) [env NANOSERVE_EVENT_LOG_URL; default: {DEFAULT_EVENT_LOG_URL}]",
    )
    parser.add_argument(
        "--grace-s", type=float, default=10.0, help="seconds streams get to finish on shutdown (default 10)"
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=float,
        default=300.0,
        help="longest wait for the replicas and the gateway, seconds (default 300)",
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        help="append each process's output to DIR/replica-N.log and DIR/smg.log (a failure at start-up "
        "quotes this run's lines)",
    )
    parser.add_argument(
        "--tenant-api-key",
        action="append",
        default=None,
        metavar="TENANT:KEY",
        help="require 'Authorization: Bearer KEY' on the OpenAI API, the caller being TENANT (repeat for more "
        "tenants; smg's --tenant-api-key); the replicas stay open on 127.0.0.1 and refuse auth flags "
        "[env NANOSERVE_GATEWAY_TENANT_API_KEYS: pairs separated by ';'; default: none: the API is open]",
    )
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then flags for every `nanoserve serve`")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import signal
    import threading
    from pathlib import Path

    from nanoserve.service.gateway.replicas import Topology, TopologyConfig

    serve_args = tuple(args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args)
    try:
        ports = _ports(args.replica_ports)
        metrics_ports = _ports(args.replica_metrics_ports)
        config = TopologyConfig(
            num_replicas=args.replicas,
            host=args.host,
            gateway_port=args.port,
            replica_ports=ports,
            replica_metrics_ports=metrics_ports,
            prometheus_port=args.prometheus_port,
            prometheus_host=args.prometheus_host,
            policy=args.policy,
            pool_id_prefix=args.pool_id_prefix,
            event_log_url=args.event_log_url,
            serve_args=serve_args,
            grace_s=args.grace_s,
            startup_timeout_s=args.startup_timeout_s,
            log_dir=Path(args.log_dir) if args.log_dir else None,
            tenant_api_keys=_tenant_api_keys(args.tenant_api_key, os.environ),
        )
    except ValueError as exc:
        print(f"nanoserve gateway: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    topology = Topology(config)
    try:
        topology.start()
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        print(f"nanoserve gateway: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps({"event": "gateway_ready", **topology.describe()}), flush=True)
    reported: set[str] = set()
    while not stop.wait(0.5):
        exited = topology.exited()
        for name in sorted(set(exited) - reported):  # a replica that goes away: the gateway routes around it
            print(json.dumps({"event": "process_exited", "name": name}), flush=True)
            reported.add(name)
        if "smg" in exited or len(exited) == len(topology.replicas):
            print(f"nanoserve gateway: {', '.join(exited)} exited; stopping the rest", file=sys.stderr)
            topology.stop()
            return EXIT_FAILED
    statuses = topology.stop()
    print(json.dumps({"event": "gateway_stopped", "exit_statuses": statuses}), flush=True)
    return EXIT_OK if all(status == 0 for status in statuses.values()) else EXIT_FAILED


def _tenant_api_keys(flags: list[str] | None, environ: Any) -> tuple[str, ...]:
    """``--tenant-api-key`` values, else ``NANOSERVE_GATEWAY_TENANT_API_KEYS`` split at ``;`` (blanks dropped)."""
    if flags:
        return tuple(flags)
    text = environ.get("NANOSERVE_GATEWAY_TENANT_API_KEYS", "")
    return tuple(pair.strip() for pair in text.split(";") if pair.strip())


def _ports(text: str | None) -> tuple[int, ...] | None:
    """``P0,P1,...`` as ports; None for None. Raises ValueError naming a part that is no integer."""
    return tuple(int(port) for port in text.split(",")) if text else None
