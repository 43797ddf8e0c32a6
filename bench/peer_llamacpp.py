"""nanoserve against llama.cpp's server engine (the ``xllamacpp`` wheel) on the same GGUF and workload.

Both engines load the same file (SmolLM2-135M-Instruct Q4_1 by default) and take
turns, round by round, so a change in the machine's load hits both. Each round of each
condition (and the warm-up) has a workload of its own, seeded ``--seed`` + its index:
prompts seen before would come from nanoserve's prefix cache. llama.cpp
runs in a child process of its own: two OpenMP pools in one process (torch's and
ggml's) wake and spin against each other, which cost nanoserve a quarter of its
single-stream speed when both lived here. llama.cpp's OpenMP waits passively (its
fastest setting here, see ``PEER_ENVIRON``) unless the environment chose. Workloads (greedy, ignore_eos):

- single stream: one chat request of ``--single-stream-tokens`` new tokens; decode
  tokens/s after the first token (ours from the request's metrics, llama.cpp's from
  its own ``timings.predicted_per_second``);
- batch: ``--num-requests`` mixed chats (prompts 20-200 tokens, 16-160 new tokens),
  ``--parallel`` at once; generated tokens / wall seconds (nanoserve runs with
  ``max_num_seqs = --parallel``, llama.cpp with that many slots);

then both again while a busy process spins on CPU 0 ("one core busy"). Both caches hold K/V
in float16 by default (llama.cpp's cache type f16; nanoserve's ``--kv-cache-dtype`` auto on
its GGUF kernels). nanoserve's KV cache
pages are written once before the runs, as llama.cpp's are at its load (``--cold-kv-cache``
leaves them to fault in during the first run, as in a fresh server). Start-up:
``nanoserve serve`` to health SERVING and llama.cpp's ``Server(...)`` constructor,
each in a fresh process, with its peak RSS (VmHWM) and, for nanoserve, the bytes
the loaded weights take (``ModelRunner.weight_bytes``).

    pip install -e '.[bench]'
    .venv/bin/python -m bench.peer_llamacpp                 # everything, 2 rounds
    .venv/bin/python -m bench.peer_llamacpp --rounds 1 --skip-busy --skip-startup
    .venv/bin/python -m bench.peer_llamacpp --workloads single --rounds 4 --skip-startup
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# llama.cpp's process: the environment as the user gave it, before nanoserve sets its OpenMP spin, with the
# wait policy it ran fastest with here unless the user chose one (single stream on 2 shared AVX2 cores:
# 44-52 tok/s with OMP_WAIT_POLICY=PASSIVE, 6-23 with libgomp's default spin, 7-34 with GOMP_SPINCOUNT=10000)
PEER_ENVIRON = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}

from bench.workload import WorkloadRequest, build_workload  # noqa: E402
from nanoserve.engine import LLM, SamplingParams, TokensPrompt  # noqa: E402
from nanoserve.engine.model.threads import available_cpus  # noqa: E402
from nanoserve.engine.model.weights import default_model_path  # noqa: E402


class LlamaCpp:
    """llama.cpp's server engine in this process: ``n_parallel`` slots, ``num_threads`` threads."""

    def __init__(
        self, model_path: str, n_parallel: int, slot_tokens: int, num_threads: int, speculative: str = "none"
    ) -> None:
        """speculative: "none", or "ngram": llama.cpp's own n-gram speculation (``ngram-simple`` at its
        defaults), for bench.speculative."""
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = model_path
        params.n_parallel = n_parallel
        params.n_ctx = n_parallel * slot_tokens
        params.cpuparams.n_threads = num_threads
        params.cpuparams_batch.n_threads = num_threads
        if speculative == "ngram":
            params.speculative.types = [xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
        self.server = xllamacpp.Server(params)

    def complete(self, prompt_token_ids: list[int], max_tokens: int) -> dict[str, Any]:
        request = {
            "prompt": prompt_token_ids,
            "n_predict": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": False,
        }
        reply: dict[str, Any] = self.server.handle_completions(request)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp refused a request: {reply['error']}")
        return reply

    def single_stream(self, request: WorkloadRequest, num_tokens: int) -> float:
        reply = self.complete(request.prompt_token_ids, num_tokens)
        return float(reply["timings"]["predicted_per_second"])

    def batch(self, workload: list[WorkloadRequest], parallel: int) -> float:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            replies = list(pool.map(lambda r: self.complete(r.prompt_token_ids, r.max_tokens), workload))
        elapsed = time.perf_counter() - start
        generated = sum(int(reply["usage"]["completion_tokens"]) for reply in replies)
        assert generated == sum(r.max_tokens for r in workload), "ignore_eos: every request runs to max_tokens"
        return generated / elapsed


def _serve_llamacpp(
    conn: Connection,
    environ: dict[str, str],
    model_path: str,
    n_parallel: int,
    slot_tokens: int,
    num_threads: int,
    speculative: str = "none",
) -> None:
    """The child process: one ``LlamaCpp``, running each (method, args) the parent sends, until None."""
    os.environ.clear()  # before xllamacpp loads its OpenMP runtime, which reads the environment once
    os.environ.update(environ)
    peer = LlamaCpp(model_path, n_parallel, slot_tokens, num_threads, speculative)
    conn.send("ready")
    while (call := conn.recv()) is not None:
        method, args = call
        conn.send(getattr(peer, method)(*args))


class LlamaCppProcess:
    """``LlamaCpp`` in a child process (spawned: no torch pool inherited), driven over a pipe."""

    def __init__(
        self, model_path: str, n_parallel: int, slot_tokens: int, num_threads: int, speculative: str = "none"
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_serve_llamacpp,
            args=(child_conn, PEER_ENVIRON, model_path, n_parallel, slot_tokens, num_threads, speculative),
            daemon=True,
        )
        self._process.start()
        if self._conn.recv() != "ready":
            raise RuntimeError("llama.cpp's process did not start")

    def _call(self, method: str, *args: Any) -> float:
        self._conn.send((method, args))
        return float(self._conn.recv())

    def single_stream(self, request: WorkloadRequest, num_tokens: int) -> float:
        return self._call("single_stream", request, num_tokens)

    def batch(self, workload: list[WorkloadRequest], parallel: int) -> float:
        return self._call("batch", workload, parallel)

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(30)


VARIANT = "nanoserve --batch-invariant off"  # the second engine of --compare-batch-invariant


def nanoserve_single_stream(llm: LLM, request: WorkloadRequest, num_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    metrics = llm.generate([TokensPrompt(request.prompt_token_ids)], params)[0].metrics
    assert metrics is not None
    assert metrics.first_token_time is not None
    assert metrics.finished_time is not None
    return (num_tokens - 1) / (metrics.finished_time - metrics.first_token_time)


def nanoserve_batch(llm: LLM, workload: list[WorkloadRequest]) -> float:
    prompts = [TokensPrompt(r.prompt_token_ids) for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    assert generated == sum(r.max_tokens for r in workload), "ignore_eos: every request runs to max_tokens"
    return generated / elapsed


@contextlib.contextmanager
def busy_core(cpu: int = 0) -> Iterator[None]:
    """A process spinning on ``cpu`` for the duration (a neighbour that never sleeps)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"],
    )
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait()


def _vm_hwm_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc status")


@dataclass(frozen=True)
class StartupFigures:
    """One ``nanoserve serve`` start: wall seconds to SERVING, and its memory from its ``model_runner.ready`` line.

    rss_before_load_bytes: interpreter and imports, when the model runner starts; load_peak_rss_bytes:
    VmHWM when the model runner is ready (the load's peak, whatever came before it included);
    peak_rss_bytes: VmHWM at SERVING, which also holds what starts after the load (the chat
    template renderer's import begins on a thread at SERVING); weight_bytes: the weights as
    loaded (``ModelRunner.weight_bytes``).
    """

    serving_s: float
    load_s: float  # the model runner's own: threads, file, weights, tokenizer, KV cache
    tokenizer_wait_s: float  # of load_s, waiting for the tokenizer's thread after the weights
    rss_before_load_bytes: int
    rss_after_load_bytes: int
    load_peak_rss_bytes: int
    peak_rss_bytes: int
    weight_bytes: int

    @property
    def load_transient_bytes(self) -> int:
        """What the load added at its peak: the load's peak minus the resident set before it."""
        return self.load_peak_rss_bytes - self.rss_before_load_bytes

    def line(self) -> str:
        mib = 2**20
        return (
            f"nanoserve serve -> SERVING {self.serving_s:.2f} s (model runner {self.load_s:.2f} s, of which "
            f"{self.tokenizer_wait_s:.2f} s waiting for the tokenizer); RSS before load "
            f"{self.rss_before_load_bytes / mib:.0f} MiB, load's peak {self.load_peak_rss_bytes / mib:.0f} MiB, "
            f"after load {self.rss_after_load_bytes / mib:.0f} MiB, peak at SERVING {self.peak_rss_bytes / mib:.0f} "
            f"MiB, weights {self.weight_bytes / mib:.0f} MiB; "
            f"load peak - before {self.load_transient_bytes / mib:.0f} MiB = "
            f"{self.load_transient_bytes / self.weight_bytes:.2f}x weights (target < 1.5x)"
        )


def nanoserve_startup(quantization: str) -> StartupFigures:
    """``nanoserve serve`` in a fresh process to health SERVING, with the memory its load took."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nanoserve.service.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--metrics-port", "off", "--event-log-url", "none", "--kv-cache-memory", "64MiB"]
    cmd += ["--quantization", quantization, "--log-level", "info", "--log-format", "json"]
    with tempfile.TemporaryFile("w+") as log_file:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            while True:  # a fresh channel per try: a failed connect would otherwise wait out grpc's reconnect backoff
                if proc.poll() is not None:
                    raise RuntimeError(f"nanoserve serve exited with {proc.returncode}")
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    try:
                        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                time.sleep(0.02)
            elapsed = time.perf_counter() - start
            peak = _vm_hwm_bytes(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
        log_file.seek(0)
        ready = next(e for e in map(_json_or_none, log_file) if e and e.get("event") == "model_runner.ready")
    return StartupFigures(
        elapsed,
        ready["load_s"],
        ready["tokenizer_wait_s"],
        ready["rss_before_load_bytes"],
        ready["rss_after_load_bytes"],
        ready["peak_rss_bytes"],
        peak,
        ready["weight_bytes"],
    )


def _json_or_none(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


LLAMACPP_STARTUP = """
import os, sys, time
start = time.perf_counter()
import xllamacpp
p = xllamacpp.CommonParams()
p.model.path = sys.argv[1]
p.n_parallel = 64
p.n_ctx = 64 * 512
server = xllamacpp.Server(p)
elapsed = time.perf_counter() - start
hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]
print(elapsed, int(hwm) * 1024, flush=True)
os._exit(0)  # the server's teardown at interpreter exit once hung for minutes: it is not what is measured
"""


def llamacpp_startup(model_path: str) -> tuple[float, int]:
    """Seconds from process start to a loaded llama.cpp server (import included), and its peak RSS."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", LLAMACPP_STARTUP, model_path], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    wall = time.perf_counter() - start
    return wall, int(out[-1])


def _fmt(values: list[float]) -> str:
    return f"{min(values):7.1f}-{max(values):7.1f}" if len(values) > 1 else f"{values[0]:7.1f}"


def _ratio(ours: list[float], theirs: list[float]) -> str:
    ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x" if len(ratios) > 1 else f"{ratios[0]:.2f}x"


def print_peer_table(
    results: dict[tuple[str, str, str], list[float]],
    conditions: list[tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]],
    workloads: list[str],
    both: bool,
) -> None:
    """nanoserve against llama.cpp per condition and workload; with both conditions, what each kept when busy."""
    print("\n| condition | workload | nanoserve tok/s | llama.cpp tok/s | ratio |\n|---|---|---|---|---|")
    for condition, _ in conditions:
        for workload_name in workloads:
            ours, theirs = (
                results[(condition, workload_name, "nanoserve")],
                results[(condition, workload_name, "llama.cpp")],
            )
            print(f"| {condition} | {workload_name} | {_fmt(ours)} | {_fmt(theirs)} | {_ratio(ours, theirs)} |")
    if both:
        for workload_name in workloads:
            for engine in ("nanoserve", "llama.cpp"):
                busy = statistics.median(results[("one core busy", workload_name, engine)])
                quiet = statistics.median(results[("quiet", workload_name, engine)])
                print(f"one core busy / quiet, {workload_name}, {engine}: {busy / quiet:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--single-stream-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per condition")
    parser.add_argument("--quantization", default="auto", help="nanoserve's --quantization")
    parser.add_argument("--dtype", default="auto", help="nanoserve's --dtype")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="nanoserve's --kv-cache-dtype (auto: float16, as llama.cpp's cache)"
    )
    parser.add_argument("--llamacpp-threads", type=int, default=None, help="default: the CPUs this process may use")
    parser.add_argument("--workloads", default="single,batch", help="comma-separated: single, batch")
    parser.add_argument("--skip-quiet", action="store_true", help="no runs without a busy core")
    parser.add_argument("--skip-busy", action="store_true", help="no runs with a busy core")
    parser.add_argument("--skip-startup", action="store_true", help="no start-up measurement")
    parser.add_argument(
        "--cold-kv-cache",
        action="store_true",
        help="leave nanoserve's KV cache pages untouched before the runs (a fresh server's first minutes)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare-batch-invariant",
        action="store_true",
        help="also run nanoserve --batch-invariant off in every round (a second engine in this process), "
        "and print what batch invariance costs",
    )
    parser.add_argument(
        "--skip-peer",
        action="store_true",
        help="no llama.cpp runs (with --compare-batch-invariant: nanoserve against itself only; on a machine so "
        "loaded that llama.cpp's passive threads crawl)",
    )
    args = parser.parse_args()

    model_path = str(default_model_path())
    threads = args.llamacpp_threads or available_cpus()
    print(f"# model {model_path}; llama.cpp threads {threads}; load {os.getloadavg()}", flush=True)

    def make_llm(batch_invariant: str) -> LLM:
        return LLM(
            quantization=args.quantization,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.parallel,
            event_log_url=None,
            kv_cache_memory=1 << 30,
            batch_invariant=batch_invariant,
        )

    llm = make_llm("auto")
    engines = {"nanoserve": llm}  # engine name -> engine
    if args.compare_batch_invariant:
        engines[VARIANT] = make_llm("off")
    print(f"# nanoserve kv cache {llm.engine.runner.kv_cache_dtype}", flush=True)
    if not args.cold_kv_cache:
        # llama.cpp clears its KV cache at load, so its pages are resident from the start; nanoserve's
        # cache is a lazily zeroed map whose pages fault in on first write (about a second of CPU per
        # GiB, paid once by a fresh server): write them now, so both engines run with a warm cache
        for nano in engines.values():
            runner = nano.engine.runner
            for cache in [*runner.kv_cache.key_caches, *runner.kv_cache.value_caches]:
                cache.zero_()
    conditions: list[tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]] = []
    if not args.skip_quiet:
        conditions.append(("quiet", contextlib.nullcontext))
    if not args.skip_busy:
        conditions.append(("one core busy", busy_core))
    # a workload of its own (another seed) for the warm-up and for every condition and round: the
    # same prompts again would be served from nanoserve's prefix cache (and a slot's prompt cache
    # in llama.cpp), which measures the cache rather than the engine
    workload_of = {
        run_id: build_workload(
            _ChatTokens(llm), args.num_requests, min_max_tokens=16, max_max_tokens=160, seed=args.seed + run_id
        )
        for run_id in range(len(conditions) * args.rounds + 1)
    }
    slot_tokens = args.single_stream_tokens + max(
        len(r.prompt_token_ids) + r.max_tokens for workload in workload_of.values() for r in workload
    )
    peer = None if args.skip_peer else LlamaCppProcess(model_path, args.parallel, slot_tokens, threads)
    workloads = args.workloads.split(",")
    warm_up = workload_of[len(conditions) * args.rounds]
    for nano in engines.values():  # warm every engine up
        nanoserve_batch(nano, warm_up[:8])
    if peer is not None:
        peer.batch(warm_up[:8], args.parallel)

    results: dict[tuple[str, str, str], list[float]] = {}
    for condition_id, (condition, context) in enumerate(conditions):
        with context():
            for round_id in range(args.rounds):
                workload = workload_of[condition_id * args.rounds + round_id]
                single = workload[0]
                runs: list[tuple[str, str, Callable[[], float]]] = [
                    *(
                        ("single", name, partial(nanoserve_single_stream, nano, single, args.single_stream_tokens))
                        for name, nano in engines.items()
                    ),
                    *(("batch", name, partial(nanoserve_batch, nano, workload)) for name, nano in engines.items()),
                ]
                if peer is not None:
                    runs.insert(
                        len(engines),
                        ("single", "llama.cpp", partial(peer.single_stream, single, args.single_stream_tokens)),
                    )
                    runs.append(("batch", "llama.cpp", partial(peer.batch, workload, args.parallel)))
                for workload_name, engine, run in runs:
                    if workload_name not in workloads:
                        continue
                    value = run()
                    results.setdefault((condition, workload_name, engine), []).append(value)
                    print(f"# {condition} round {round_id} {workload_name} {engine}: {value:.1f} tok/s", flush=True)

    if peer is not None:
        print_peer_table(results, conditions, workloads, both=not (args.skip_busy or args.skip_quiet))
    if args.compare_batch_invariant:
        for condition, _ in conditions:
            for workload_name in workloads:
                on, off = results[(condition, workload_name, "nanoserve")], results[(condition, workload_name, VARIANT)]
                peer_ratio = (
                    f"; {VARIANT} / llama.cpp {_ratio(off, results[(condition, workload_name, 'llama.cpp')])}"
                    if peer is not None
                    else ""
                )
                print(
                    f"{condition}, {workload_name}: nanoserve {_fmt(on)} tok/s batch-invariant, {_fmt(off)} without "
                    f"(on/off {_ratio(on, off)}){peer_ratio}"
                )
    print(f"nanoserve weights in memory: {llm.engine.runner.weight_bytes / 2**20:.1f} MiB", flush=True)
    for nano in engines.values():
        nano.shutdown()
    if peer is not None:
        peer.close()

    if not args.skip_startup:
        for _ in range(args.rounds):
            ours = nanoserve_startup(args.quantization)
            theirs_s, theirs_rss = llamacpp_startup(model_path)
            print(
                f"start-up: {ours.line()}; "
                f"llama.cpp (python + import + load) {theirs_s:.2f} s, peak RSS {theirs_rss / 2**20:.0f} MiB",
                flush=True,
            )


class _ChatTokens:
    """The chat template of nanoserve's tokenizer, as ``build_workload`` wants it."""

    def __init__(self, llm: LLM) -> None:
        self.tokenizer = llm.tokenizer

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages)


if __name__ == "__main__":
    main()
