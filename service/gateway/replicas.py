"""Several nanoserve replicas behind the Shepherd Model Gateway (``smg``), as processes on one machine.

::

    client ──HTTP (OpenAI API)──▶ smg launch --backend vllm --policy cache_aware
                                    │  grpc: vllm.grpc.engine.VllmEngine
                   ┌────────────────┼────────────────┐
                   ▼                                 ▼
    nanoserve serve --pool-id replica-0   nanoserve serve --pool-id replica-1   ...
                   └──────────── one event log (--event-log-url) ────────────┘

The gateway serves the OpenAI API (chat, completions, responses, SSE), tokenizes
with the tokenizer it fetched from a replica (``GetTokenizer``), and routes each
request to a replica. Every replica runs ``nanoserve serve`` with its own port
and pool id and the same other flags, so they share one event log, each pool
audited on its own (``nanoserve log audit --pool replica-0``).

``Topology`` starts them (replicas first, each waited for until its health is
SERVING, then the gateway, waited for until every replica is registered and
healthy) and stops them (the gateway first, so no request reaches a replica
that is going away; then every replica with one SIGTERM: streams drain for the
grace, epochs close). Each process runs in a session of its own, so a terminal's
Ctrl-C reaches only the launcher; a launcher killed with SIGKILL leaves them
running. ``nanoserve gateway`` is its command line; the tests drive it the same
way.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from nanoserve.allocator.log import DEFAULT_EVENT_LOG_URL
from nanoserve.service.cli.client import open_channel, wait_ready

# serve settings that make a replica demand credentials or TLS: smg 1.13 reaches its gRPC workers in
# plaintext and without credentials (its --api-key is not sent to them: their HealthCheck answers
# UNAUTHENTICATED and the worker is never registered), so a replica behind it must be open on 127.0.0.1
REPLICA_AUTH_SETTINGS = ("auth_token", "auth_tokens", "auth_tokens_file", "tls_cert", "tls_key", "tls_client_ca")
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
POLICIES = ("cache_aware", "prefix_hash", "least_load", "power_of_two", "round_robin", "random", "consistent_hashing")
POLL_INTERVAL_S = 0.25
NUM_TAIL_LINES = 12  # a process's last lines of output quoted when it exits at start


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it; another process may take it after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def smg_executable() -> str:
    """The ``smg`` launcher installed beside this Python, else the one on PATH.

    Raises FileNotFoundError naming the package to install.
    """
    beside = Path(sys.executable).parent / "smg"
    if beside.is_file():
        return str(beside)
    found = shutil.which("smg")
    if found is None:
        raise FileNotFoundError("the smg gateway is not installed: pip install 'nanoserve[gateway]' (PyPI package smg)")
    return found


@dataclass(frozen=True)
class TopologyConfig:
    """What to start.

    host / gateway_port: where smg serves the OpenAI API (port 0: a free port).
    replica_ports: one gRPC port per replica (None: free ports), on 127.0.0.1.
    replica_metrics_ports: one Prometheus port per replica (None: free ports), on 127.0.0.1
        (``nanoserve serve``'s ``--metrics-host`` default); ``serve_args`` may turn them off
        (``--metrics-port off``) but not give them all one port.
    prometheus_port: smg's /metrics (0: a free port).
    prometheus_host: where smg's /metrics listens (default 127.0.0.1: it answers without a key, as
        ``nanoserve serve``'s ``--metrics-host`` does; smg's own default is every interface).
    policy: smg's routing policy (``POLICIES``).
    pool_id_prefix: replica i writes the log under pool id ``{prefix}-{i}``.
    event_log_url: the one log every replica writes (``none``: no log); migrated once before they start.
    serve_args: flags for every ``nanoserve serve`` (model, pool size, ...).
    grace_s: seconds in-flight streams get on shutdown, at the gateway and at each replica.
    startup_timeout_s: the longest a replica may take to serve, or the gateway to see them all.
    log_dir: each process writes its output to ``replica-N.log`` / ``smg.log`` there (None: this
        process's stdout and stderr).
    tenant_api_keys: ``TENANT:KEY`` pairs handed to smg (``--tenant-api-key``): with any, the
        OpenAI API answers 401 to a request without one of the keys, and smg scopes what it stores
        (responses, conversations) to the key's tenant. The replicas behind it stay open on
        127.0.0.1 (``REPLICA_AUTH_SETTINGS``).
    """

    num_replicas: int = 2
    host: str = "127.0.0.1"
    gateway_port: int = 8000
    replica_ports: tuple[int, ...] | None = None
    replica_metrics_ports: tuple[int, ...] | None = None
    prometheus_port: int = 29000
    prometheus_host: str = "127.0.0.1"
    policy: str = "cache_aware"
    pool_id_prefix: str = "replica"
    event_log_url: str = DEFAULT_EVENT_LOG_URL
    serve_args: tuple[str, ...] = ()
    grace_s: float = 10.0
    startup_timeout_s: float = 300.0
    log_dir: Path | None = None
    tenant_api_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        for name in ("replica_ports", "replica_metrics_ports"):
            ports = getattr(self, name)
            if ports is not None and len(ports) != self.num_replicas:
                raise ValueError(f"{name} must name {self.num_replicas} ports (one per replica), got {len(ports)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0 seconds, got {self.grace_s}")
        for flag in ("--port", "--pool-id", "--host", "--grace-s", "--event-log-url"):
            if any(serve_flag_of(arg) == flag for arg in self.serve_args):
                raise ValueError(f"serve_args must not set {flag}: the topology sets it per replica")
        refused = replica_auth_flags()
        for arg in self.serve_args:
            set_flag = serve_flag_of(arg)
            if set_flag is not None and set_flag in refused:
                flag = set_flag
                written = arg.split("=", 1)[0]
                raise ValueError(
                    f"serve_args must not set {flag}{'' if written == flag else f' (written {written})'}: smg "
                    "reaches the replicas in plaintext without credentials, so a replica that demands them or "
                    "TLS is never routed to; require keys at the gateway (--tenant-api-key TENANT:KEY) instead"
                )
        tenants: set[str] = set()
        for number, pair in enumerate(self.tenant_api_keys, 1):
            tenant, colon, key = pair.partition(":")
            if not colon or not TENANT_NAME.fullmatch(tenant) or not key or any(c.isspace() for c in key):
                raise ValueError(  # the value is not quoted: it may be a key
                    f"tenant_api_keys: entry {number} is not TENANT:KEY (a tenant of 1..64 of A-Z a-z 0-9 . _ -, "
                    "then a key without spaces)"
                )
            if tenant in tenants:
                raise ValueError(f"tenant_api_keys: tenant {tenant!r} is named twice")
            tenants.add(tenant)
        metrics = _flag_value(self.serve_args, "--metrics-port")
        if metrics is not None and metrics.lower() not in ("off", "none", ""):
            raise ValueError(
                f"serve_args must not set --metrics-port {metrics}: every replica would bind it; the topology "
                "gives each its own (replica_metrics_ports), or pass --metrics-port off"
            )

    @property
    def replica_metrics_off(self) -> bool:
        """``serve_args`` turn the replicas' Prometheus endpoints off (``--metrics-port off``)."""
        return _flag_value(self.serve_args, "--metrics-port") is not None


@dataclass
class Replica:
    """One ``nanoserve serve`` process: its pool id in the log, its gRPC port on 127.0.0.1 and its
    Prometheus port (None: off)."""

    pool_id: str
    port: int
    metrics_port: int | None
    process: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def worker_url(self) -> str:
        """How smg names it: ``grpc://`` selects the gRPC (VllmEngine) connection."""
        return f"grpc://{self.address}"


@dataclass
class Topology:
    """smg in front of ``num_replicas`` nanoserve processes; a context manager that stops them all."""

    config: TopologyConfig
    replicas: list[Replica] = field(default_factory=list)
    gateway: subprocess.Popen[bytes] | None = None
    gateway_port: int | None = None
    prometheus_port: int | None = None
    _log_files: list[IO[bytes]] = field(default_factory=list)
    # log file name -> its size when this run opened it (log_dir set)
    _log_starts: dict[str, int] = field(default_factory=dict)
    # process name -> (the thread copying its stderr through, its last lines), when log_dir is None
    _tails: dict[str, tuple[threading.Thread, deque[str]]] = field(default_factory=dict)

    @property
    def gateway_url(self) -> str:
        """The OpenAI API's base, ``http://host:port`` (the client's ``base_url`` is this plus ``/v1``)."""
        assert self.gateway_port is not None, "start() first"
        return f"http://{self.config.host}:{self.gateway_port}"

    def start(self) -> None:
        """Starts the replicas, then the gateway; returns when the gateway routes to every replica.

        Raises RuntimeError (naming the process and its log) when one exits or
        does not get ready within ``startup_timeout_s``; whatever was started is stopped.
        """
        try:
            self._start_replicas()
            self._start_gateway()
        except BaseException:
            self.stop()
            raise

    def _start_replicas(self) -> None:
        config = self.config
        inherited = replica_auth_in_environment(os.environ)
        if inherited:
            raise RuntimeError(
                f"{', '.join(inherited)} set in the environment: every replica would inherit it and demand "
                "credentials smg does not send (it reaches the replicas in plaintext without a token), so no "
                "request would be routed; unset it, and require keys at the gateway with --tenant-api-key TENANT:KEY"
            )
        if config.event_log_url != "none":
            from nanoserve.migrations import upgrade

            upgrade(config.event_log_url)  # once, so that the replicas do not race to create the schema
        ports = config.replica_ports or tuple(0 for _ in range(config.num_replicas))
        metrics_ports = config.replica_metrics_ports or tuple(0 for _ in range(config.num_replicas))
        for index, (port, metrics_port) in enumerate(zip(ports, metrics_ports, strict=True)):
            pool_id = f"{config.pool_id_prefix}-{index}"
            port = port or free_port()
            # each its own: replicas sharing serve's default (9090) die on the second bind
            replica_metrics: int | None = None if config.replica_metrics_off else metrics_port or free_port()
            metrics_flag = [] if replica_metrics is None else ["--metrics-port", str(replica_metrics)]
            command = [
                sys.executable,
                "-m",
                "nanoserve.service.cli.main",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--pool-id",
                pool_id,
                "--grace-s",
                str(config.grace_s),
                "--event-log-url",
                config.event_log_url,
                *metrics_flag,
                *config.serve_args,
            ]
            process = self._spawn(command, f"{pool_id}.log", pool_id)
            self.replicas.append(Replica(pool_id, port, replica_metrics, process))
        deadline_s = time.monotonic() + config.startup_timeout_s
        for replica in self.replicas:
            with open_channel(replica.address) as channel:
                while not wait_ready(channel, POLL_INTERVAL_S * 4):
                    self._check_alive(replica.process, replica.pool_id, f"{replica.pool_id}.log")
                    if time.monotonic() > deadline_s:
                        raise RuntimeError(
                            f"replica {replica.pool_id} ({replica.address}) not serving after "
                            f"{config.startup_timeout_s} s; see {self._log_name(f'{replica.pool_id}.log')}"
                        )

    def _start_gateway(self) -> None:
        config = self.config
        self.gateway_port = config.gateway_port or free_port(config.host)
        self.prometheus_port = config.prometheus_port or free_port()
        command = self.smg_command()
        self.gateway = self._spawn(command, "smg.log", "smg")
        deadline_s = time.monotonic() + config.startup_timeout_s
        while not self._gateway_sees_all():
            self._check_alive(self.gateway, "smg", "smg.log")
            if time.monotonic() > deadline_s:
                raise RuntimeError(
                    f"smg at {self.gateway_url} does not route to all {config.num_replicas} replicas after "
                    f"{config.startup_timeout_s} s; see {self._log_name('smg.log')}"
                )
            time.sleep(POLL_INTERVAL_S)

    def smg_command(self) -> list[str]:
        """``smg launch`` in front of the replicas, on ``gateway_port`` and ``prometheus_port``."""
        config = self.config
        command = [
            smg_executable(),
            "launch",
            "--backend",
            "vllm",
            "--worker-urls",
            *(replica.worker_url for replica in self.replicas),
            "--policy",
            config.policy,
            "--host",
            config.host,
            "--port",
            str(self.gateway_port),
            "--prometheus-port",
            str(self.prometheus_port),
            "--prometheus-host",
            config.prometheus_host,
            "--shutdown-grace-period-secs",
            str(max(1, round(config.grace_s))),
            "--log-json",
        ]
        for pair in config.tenant_api_keys:
            command += ["--tenant-api-key", pair]
        return command

    def _gateway_sees_all(self) -> bool:
        """smg's /readiness counts every replica healthy, and it has their model (its tokenizer loaded)."""
        readiness = _get_json(f"{self.gateway_url}/readiness")
        models = _get_json(f"{self.gateway_url}/v1/models")
        if readiness is None or models is None:
            return False
        return bool(readiness.get("healthy_workers") == len(self.replicas) and models.get("data"))

    def stop(self, timeout_s: float | None = None) -> dict[str, int | None]:
        """SIGTERM to the gateway, then to every replica (each drains its streams for ``grace_s``);
        waits for them, SIGKILLs what is left after ``timeout_s`` (default: grace_s plus 30 s).
        Returns each process's exit status (None: it had to be killed). Safe to call twice."""
        timeout_s = self.config.grace_s + 30.0 if timeout_s is None else timeout_s
        statuses: dict[str, int | None] = {}
        if self.gateway is not None:
            statuses["smg"] = _terminate(self.gateway, timeout_s)
        for replica in self.replicas:  # all at once: they drain side by side
            _signal(replica.process, signal.SIGTERM)
        for replica in self.replicas:
            statuses[replica.pool_id] = _wait_or_kill(replica.process, timeout_s)
        for log_file in self._log_files:
            log_file.close()
        self._log_files.clear()
        return statuses

    def exited(self) -> list[str]:
        """The processes that have exited, by name (``smg``, ``replica-0``, ...): empty while all run."""
        processes = [("smg", self.gateway)] if self.gateway is not None else []
        processes += [(replica.pool_id, replica.process) for replica in self.replicas]
        return [name for name, process in processes if process is not None and process.poll() is not None]

    def __enter__(self) -> Topology:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def describe(self) -> dict[str, Any]:
        """The topology as JSON-ready values: the gateway's URL and each replica's pool, address and pid."""
        return {
            "gateway_url": self.gateway_url,
            "openai_base_url": f"{self.gateway_url}/v1",
            "prometheus_port": self.prometheus_port,
            "policy": self.config.policy,
            "gateway_pid": self.gateway.pid if self.gateway is not None else None,
            "replicas": [
                {
                    "pool_id": replica.pool_id,
                    "address": replica.address,
                    "metrics_port": replica.metrics_port,
                    "pid": replica.process.pid,
                }
                for replica in self.replicas
            ],
        }

    def _spawn(self, command: list[str], log_name: str, name: str) -> subprocess.Popen[bytes]:
        """Starts ``command``; its output goes to ``log_name`` in log_dir, or (log_dir None) its stdout and
        stderr are copied line by line to our stderr, the last NUM_TAIL_LINES kept for ``_check_alive``:
        our stdout carries the ``gateway_ready`` line alone, for a script to read."""
        output: IO[bytes] | None = None
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            output = (self.config.log_dir / log_name).open("ab")
            self._log_files.append(output)
            # the file is appended to across runs: a failure quotes this run's lines only, from here on
            self._log_starts[log_name] = output.seek(0, os.SEEK_END)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # a session of its own: Ctrl-C in a terminal reaches this process alone, which then stops the
        # gateway and the replicas in order (a replica signalled twice would cut its drain short)
        process = subprocess.Popen(
            command,
            stdout=output or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        if output is None:
            tail: deque[str] = deque(maxlen=NUM_TAIL_LINES)
            copier = threading.Thread(target=_copy_output, args=(process, tail), name=f"{name}-output", daemon=True)
            copier.start()
            self._tails[name] = (copier, tail)
        return process

    def _check_alive(self, process: subprocess.Popen[bytes], name: str, log_name: str) -> None:
        """Raises RuntimeError naming the process, its exit status and its last lines of output when it exited."""
        if process.poll() is None:
            return
        lines = self._last_lines(name, log_name)
        quoted = "".join(f"\n  {name} | {line}" for line in lines) if lines else " (it wrote nothing)"
        what = name if name == "smg" else f"replica {name}"
        raise RuntimeError(
            f"{what} exited with status {process.returncode} while starting; its last lines:{quoted}\n"
            f"(all of it: {self._log_name(log_name)})"
        )

    def _last_lines(self, name: str, log_name: str) -> list[str]:
        """An exited process's last lines of output: its log file's, or those its stderr copier kept."""
        if self.config.log_dir is not None:
            with contextlib.suppress(OSError), (self.config.log_dir / log_name).open("rb") as log_file:
                log_file.seek(self._log_starts.get(log_name, 0))
                text = log_file.read().decode("utf-8", errors="replace")
                return text.splitlines()[-NUM_TAIL_LINES:]
            return []
        if name not in self._tails:
            return []
        copier, tail = self._tails[name]
        copier.join(timeout=2.0)  # it reads to EOF, which the exited process has sent (unless a child holds it)
        return list(tail)

    def _log_name(self, log_name: str) -> str:
        return str(self.config.log_dir / log_name) if self.config.log_dir is not None else "its output above"


def _copy_output(process: subprocess.Popen[bytes], tail: deque[str]) -> None:
    """Copies a process's output (stdout and stderr) to our stderr line by line until it closes, keeping
    the last lines in ``tail``."""
    assert process.stdout is not None, "spawned with stdout=PIPE"
    for raw in process.stdout:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
        tail.append(raw.decode("utf-8", "replace").rstrip("\n"))


def replica_auth_flags() -> tuple[str, ...]:
    """The ``nanoserve serve`` flags of ``REPLICA_AUTH_SETTINGS`` (``--auth-token``, ``--tls-cert``, ...)."""
    from nanoserve.service.settings import SETTINGS

    return tuple(setting.flag for setting in SETTINGS if setting.name in REPLICA_AUTH_SETTINGS)


def serve_flag_of(arg: str) -> str | None:
    """The ``nanoserve serve`` flag ``arg`` sets as argparse reads it: ``--flag``, ``--flag=V``, or an
    abbreviation that starts one flag only (``--auth-tokens-f`` is ``--auth-tokens-file``); None for
    a value, an unknown or an ambiguous name (which serve refuses itself)."""
    from nanoserve.service.setting import parse_bool
    from nanoserve.service.settings import SETTINGS

    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0]
    flags = {setting.flag for setting in SETTINGS} | {
        "--no-" + setting.flag[2:] for setting in SETTINGS if setting.parse is parse_bool
    }
    if name in flags:
        return name
    matches = [flag for flag in flags if flag.startswith(name)]
    return matches[0] if len(matches) == 1 else None


def replica_auth_in_environment(environ: Mapping[str, str]) -> list[str]:
    """The environment variables of ``REPLICA_AUTH_SETTINGS`` set (non-empty) in ``environ``, which
    every replica would inherit (``NANOSERVE_AUTH_TOKEN``, ...)."""
    from nanoserve.service.settings import SETTINGS

    return [setting.env for setting in SETTINGS if setting.name in REPLICA_AUTH_SETTINGS and environ.get(setting.env)]


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value ``args`` give ``flag`` (``--flag V`` or ``--flag=V``; the last wins); None when absent."""
    value: str | None = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def _get_json(url: str) -> dict[str, Any] | None:
    """The JSON object at ``url``; None when it does not answer 200 with one (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            body = json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _signal(process: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)


def _terminate(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; the exit status, or None when it was killed."""
    _signal(process, signal.SIGTERM)
    return _wait_or_kill(process, timeout_s)


def _wait_or_kill(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """Waits up to ``timeout_s`` for a process already told to stop, then SIGKILLs it.

    One SIGTERM only: a server takes its second SIGTERM or SIGINT as "stop now"
    (its handlers are gone once its graceful shutdown began), cutting that shutdown short.
    """
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None
