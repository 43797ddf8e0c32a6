"""Speculative decoding by prompt lookup: one greedy stream, tok/s with it on against off, same process.

Three chat prompts, each answered greedily by the default model (SmolLM2-135M-Instruct GGUF):

* ``copy-heavy``: "Repeat this text exactly: ..." (the answer quotes the prompt);
* ``code edit``: "Rename the variable n to total in this Python function" (the answer rewrites the code);
* ``plain chat``: a question whose answer repeats nothing of the prompt.

For each: output tokens per second with ``--speculative off`` (the peer) and ``ngram``
(``--k`` drafts), their ratio, the drafts' acceptance rate, and whether the tokens are equal.
With the ``bench`` extra (``xllamacpp``), llama.cpp's server engine runs the same prompt token
ids greedily for as many tokens, with and without its own n-gram speculation (``ngram-simple``
at its defaults), in child processes; its rate is its ``predicted_per_second`` (generation
only), ours counts the prefill too, which favours llama.cpp slightly.

    .venv/bin/python -m bench.speculative
    .venv/bin/python -m bench.speculative --max-tokens 64 --k 8 --quantization none
    .venv/bin/python -m bench.speculative --batch-invariant on    # verify passes on the int16 panels
    .venv/bin/python -m bench.speculative --batch 64 --skip-peer   # and 64 chats at once, on against off
    .venv/bin/python -m bench.speculative --threads 1 --skip-peer --k 3,5,7 --repeats 5   # a shared machine

``--k`` takes several values (one engine each, beside the one with speculation off); with
``--repeats N`` every prompt runs N rounds, each round off and then every k in turn, and the
table gives each k's median ratio against the off run of the same round, with the lowest and
highest ratio, by wall time and by the process's CPU time (``time.process_time``; with
``--threads 1`` that is the one compute thread's work, which other processes on a shared
machine slow far less than they slow the wall clock): alternating in one process, repeating,
and counting CPU time is what makes the ratio mean something there.
"""

from __future__ import annotations

import argparse
import statistics
import time

from nanoserve.engine import LLM, ChatPrompt, SamplingParams, TokensPrompt

COPY_TEXT = (
    "Invoice 2041: 3 boxes of blue pens at 4.50 each, 2 reams of A4 paper at 6.20 each, 1 stapler at 12.00, "
    "5 folders at 1.10 each, 4 boxes of blue pens at 4.50 each, 2 reams of A4 paper at 6.20 each."
)
CODE = (
    "def total_price(items):\n"
    "    n = 0\n"
    "    for item in items:\n"
    "        if item.quantity > 0:\n"
    "            n += item.price * item.quantity\n"
    "    return n\n"
)
PROMPTS = {
    "copy-heavy": ChatPrompt([{"role": "user", "content": f"Repeat this text exactly: {COPY_TEXT}"}]),
    "code edit": ChatPrompt(
        [{"role": "user", "content": f"Rename the variable n to total in this Python function:\n\n{CODE}"}]
    ),
    "plain chat": ChatPrompt([{"role": "user", "content": "Write a short story about a robot learning to paint."}]),
}


def run(llm: LLM, prompt: ChatPrompt, max_tokens: int) -> tuple[list[int], float]:
    """(output tokens, seconds) of one greedy request."""
    start = time.perf_counter()
    [output] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return output.outputs[0].token_ids, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", default="3", help="--num-speculative-tokens; comma-separated: one engine each")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per prompt, each off then every k")
    parser.add_argument("--threads", type=int, default=None, help="--num-threads (default: the engine's choice)")
    parser.add_argument("--quantization", default="auto", help="--quantization (none: the dequantized float32 model)")
    parser.add_argument("--ngram-min", type=int, default=None, help="--speculative-ngram-min (default: the engine's)")
    parser.add_argument("--batch", type=int, default=0, help="also this many chats at once, on against off")
    parser.add_argument("--skip-peer", action="store_true", help="no llama.cpp runs (without the bench extra)")
    parser.add_argument("--batch-invariant", default="off", choices=("on", "auto", "off"), help="--batch-invariant")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    settings = {"num_threads": args.threads, "quantization": args.quantization, "batch_invariant": args.batch_invariant}
    if len(ks) > 1:
        settings["num_kv_blocks"] = 512  # one stream needs few; each engine would otherwise take 1 GiB of cache
    off = LLM(**settings)
    ngram = {} if args.ngram_min is None else {"speculative_ngram_min": args.ngram_min}
    ons = {k: LLM(**settings, speculative="ngram", num_speculative_tokens=k, **ngram) for k in ks}
    for llm in (off, *ons.values()):
        run(llm, PROMPTS["plain chat"], 4)  # warm-up
    if len(ks) > 1 or args.repeats > 1:
        _rounds(off, ons, args.max_tokens, args.repeats)
        for llm in (off, *ons.values()):
            llm.shutdown()
        return
    on = ons[ks[0]]
    print(
        f"one greedy stream, max_tokens {args.max_tokens}, k {ks[0]}, quantization {args.quantization}, "
        f"batch invariant {args.batch_invariant}"
    )
    print("| prompt | tokens | off tok/s | ngram tok/s | x off | accepted / drafted | tokens equal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, prompt in PROMPTS.items():
        before = on.engine.pool_status()
        tokens_off, seconds_off = run(off, prompt, args.max_tokens)
        tokens_on, seconds_on = run(on, prompt, args.max_tokens)
        after = on.engine.pool_status()
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
        rate_off, rate_on = len(tokens_off) / seconds_off, len(tokens_on) / seconds_on
        print(
            f"| {name} | {len(tokens_on)} | {rate_off:.1f} | {rate_on:.1f} | {rate_on / rate_off:.2f} | "
            f"{accepted} / {drafted} | {tokens_on == tokens_off} |"
        )
    if args.batch:
        _batch(off, on, args.batch, args.max_tokens)
    off.shutdown()
    on.shutdown()
    if not args.skip_peer:
        _peer(off.engine.tokenizer, args.max_tokens, args.threads or 1)


def _rounds(off: LLM, ons: dict[int, LLM], max_tokens: int, repeats: int) -> None:
    """Per prompt, ``repeats`` rounds of off then each k; per k the median, lowest and highest ratio of its
    rate to the same round's off rate, the median off rate, acceptance per run, and whether every run's
    tokens equal off's."""
    print(f"one greedy stream, max_tokens {max_tokens}, {repeats} rounds of off then each k, alternating")
    print(
        "| prompt | k | tokens | off tok/s (median) | x off, wall: median (lowest-highest) "
        "| x off, CPU time: median (lowest-highest) | accepted / drafted | equal |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, prompt in PROMPTS.items():
        rates_off: list[float] = []
        ratios: dict[int, list[float]] = {k: [] for k in ons}
        cpu_ratios: dict[int, list[float]] = {k: [] for k in ons}
        counts = {k: [0, 0] for k in ons}
        equal = dict.fromkeys(ons, True)
        lengths: dict[int, int] = {}
        for _ in range(repeats):
            cpu_start = time.process_time()
            tokens_off, seconds_off = run(off, prompt, max_tokens)
            cpu_off = time.process_time() - cpu_start
            rates_off.append(len(tokens_off) / seconds_off)
            for k, on in ons.items():
                before = on.engine.pool_status()
                cpu_start = time.process_time()
                tokens_on, seconds_on = run(on, prompt, max_tokens)
                cpu_on = time.process_time() - cpu_start
                after = on.engine.pool_status()
                cpu_ratios[k].append(len(tokens_on) / cpu_on / (len(tokens_off) / cpu_off))
                counts[k][0] += after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
                counts[k][1] += after.num_draft_tokens - before.num_draft_tokens
                ratios[k].append(len(tokens_on) / seconds_on / rates_off[-1])
                equal[k] = equal[k] and tokens_on == tokens_off
                lengths[k] = len(tokens_on)
        for k, values in ratios.items():
            accepted, drafted = (count // repeats for count in counts[k])
            print(
                f"| {name} | {k} | {lengths[k]} | {statistics.median(rates_off):.1f} | {_spread(values)} | "
                f"{_spread(cpu_ratios[k])} | {accepted} / {drafted} | {equal[k]} |"
            )


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _batch(off: LLM, on: LLM, num_requests: int, max_tokens: int) -> None:
    """``num_requests`` chats at once (``bench.workload``'s mixed ones, greedy): throughput with speculation
    on against off, the batch the issue asks to keep within 5% of."""
    from bench.workload import build_workload

    workload = build_workload(off.engine.tokenizer, num_requests, seed=0)
    prompts = [TokensPrompt(r.prompt_token_ids) for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=min(r.max_tokens, max_tokens)) for r in workload]
    rates = []
    for llm in (off, on):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
    print(f"batch of {num_requests} mixed chats, greedy, up to {max_tokens} tokens each")
    print("| off tok/s | ngram tok/s | x off |\n| --- | --- | --- |")
    print(f"| {rates[0]:.1f} | {rates[1]:.1f} | {rates[1] / rates[0]:.2f} |")


def _peer(tokenizer: object, max_tokens: int, num_threads: int) -> None:
    """llama.cpp's rates on the same prompts, without and with its n-gram speculation, and ours against them."""
    from bench.peer_llamacpp import LlamaCppProcess
    from bench.workload import WorkloadRequest
    from nanoserve.engine.model.weights import default_model_path

    print(f"llama.cpp's server engine (xllamacpp), {num_threads} thread(s), the same prompt ids, {max_tokens} tokens")
    print("| prompt | llama.cpp tok/s | llama.cpp ngram tok/s | x its off |")
    print("| --- | --- | --- | --- |")
    peers = {spec: LlamaCppProcess(str(default_model_path()), 1, 2048, num_threads, spec) for spec in ("none", "ngram")}
    try:
        for name, prompt in PROMPTS.items():
            ids = tokenizer.apply_chat_template(prompt.messages)  # type: ignore[attr-defined]
            request = WorkloadRequest(prompt.messages, ids, max_tokens)
            rates = {spec: peer.single_stream(request, max_tokens) for spec, peer in peers.items()}
            print(f"| {name} | {rates['none']:.1f} | {rates['ngram']:.1f} | {rates['ngram'] / rates['none']:.2f} |")
    finally:
        for peer in peers.values():
            peer.close()


if __name__ == "__main__":
    main()
