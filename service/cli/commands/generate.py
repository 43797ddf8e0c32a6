"""``nanoserve generate``: stream a completion from a running server and print it.

The text is printed as it streams; ``--json`` prints one JSON object per
streamed message instead (protobuf field names), for scripts. Ctrl-C cancels
the call (the server aborts the request) and exits 130.

With ``--wait-ready SECONDS``, a stream cut because the server went away
(UNAVAILABLE: it crashed or was killed) is resumed: the command waits up to
that long for the server to be SERVING again, then calls ``Resume`` with the
number of token ids it has received, and says so on stderr. The restarted
server recovered the request from its journal, so the printed completion has
no token missing and none repeated. The command picks the request id itself
then (the server's choice would be lost with the first message).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import uuid
from typing import Any

from nanoserve.engine.sampling.limits import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY
from nanoserve.service.cli.arguments import INT32_MAX, INT64_MAX, INT64_MIN, add_connection_flags, integer, number, salt

# a CLI user expects a whole answer; API clients that leave max_tokens unset get the engine's default
DEFAULT_MAX_TOKENS = 256
EXIT_ABORTED = 1  # the request ended with finish reason abort (the finish line names the cause)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
LOGPROBS_NOTE = "note: --logprobs: the logprobs are in the --json output; this prints the text"
PROMPT_LOGPROBS_NOTE = "note: --prompt-logprobs: the prompt's logprobs are in the --json output; this prints the text"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream a completion from a running server",
        description="Send one request to a nanoserve server and print the completion as it streams.",
    )
    parser.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user chat message, rendered with the model's chat template",
    )
    parser.add_argument(
        "--system", default=None, help="a system message placed before the user message (implies --chat)"
    )
    add_connection_flags(parser)
    parser.add_argument("--request-id", default="", help="request id (default: the server assigns one)")
    parser.add_argument(
        "--timeout",
        type=number(0.0, low_open=True),
        default=None,
        metavar="SECONDS",
        help="deadline of the call; when it passes the server aborts the request",
    )
    parser.add_argument(
        "--wait-ready",
        type=number(0.0),
        default=0.0,
        metavar="SECONDS",
        help="first wait up to this long for the server's health to be SERVING (for scripts that just started it); "
        "a stream cut because the server went away is then resumed when it is SERVING again within this long",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per streamed message instead of the text"
    )
    sampling = parser.add_argument_group("sampling (unset: the engine's defaults)")
    sampling.add_argument(
        "--max-tokens",
        type=integer(1),
        default=DEFAULT_MAX_TOKENS,
        help=f"new tokens at most (>= 1) [default: {DEFAULT_MAX_TOKENS}, the API's default is the engine's]",
    )
    sampling.add_argument(
        "--min-tokens", type=integer(0), default=0, help="new tokens before EOS or a stop may end the request"
    )
    sampling.add_argument("--temperature", type=number(0.0), default=None, help="0 = greedy")
    sampling.add_argument(
        "--top-p", type=number(0.0, 1.0, low_open=True), default=None, help="nucleus sampling mass, in (0, 1]"
    )
    sampling.add_argument(
        "--top-k", type=integer(0), default=None, help="sample from the k most likely tokens (0 = off)"
    )
    sampling.add_argument(
        "--min-p", type=number(0.0, 1.0), default=None, help="drop tokens below min_p x the top probability, in [0, 1]"
    )
    sampling.add_argument(
        "--seed", type=integer(INT64_MIN, INT64_MAX), default=None, help="per-request seed (reproducible sampling)"
    )
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not printed")
    sampling.add_argument(
        "--stop-token-id", type=integer(0), action="append", default=[], help="stop token id (repeatable)"
    )
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    sampling.add_argument("--repetition-penalty", type=number(0.0, low_open=True), default=None, help="> 0; 1 = off")
    sampling.add_argument(
        "--presence-penalty", type=number(-MAX_PENALTY, MAX_PENALTY), default=None, help="in [-2, 2]; 0 = off"
    )
    sampling.add_argument(
        "--frequency-penalty", type=number(-MAX_PENALTY, MAX_PENALTY), default=None, help="in [-2, 2]; 0 = off"
    )
    sampling.add_argument(
        "--logprobs",
        type=integer(0, MAX_LOGPROBS),
        default=None,
        help=f"return the chosen token's logprob and the top N (0..{MAX_LOGPROBS})",
    )
    sampling.add_argument(
        "--n",
        type=integer(1),
        default=None,
        help="samples of the prompt (1..the server's --max-parallel-samples); each is printed whole when it ends",
    )
    sampling.add_argument(
        "--best-of",
        type=integer(1),
        default=None,
        help="samples generated (>= n); the n of highest cumulative logprob return",
    )
    sampling.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        type=_bias_entry,
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable, at most 300)",
    )
    sampling.add_argument(
        "--prompt-logprobs",
        type=integer(0, MAX_LOGPROBS),
        default=None,
        help=f"also return each prompt token's logprob and the top N (0..{MAX_LOGPROBS})",
    )
    sampling.add_argument(
        "--truncate-prompt-tokens",
        type=integer(1, also=-1),
        default=None,
        help="keep the prompt's last N tokens (-1: the last max_model_len - 1, room for one new token; to leave "
        "room for --max-tokens M, give max_model_len - M)",
    )
    structured = parser.add_argument_group("structured output (at most one; the output must match it)")
    constraint = structured.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", type=_file_text, default=None, metavar="FILE", help="a JSON Schema document (file)"
    )
    constraint.add_argument("--regex", default=None, help="a regular expression the whole output matches")
    constraint.add_argument(
        "--grammar", type=_file_text, default=None, metavar="FILE", help="a Lark (llguidance) or GBNF grammar (file)"
    )
    constraint.add_argument(
        "--choice", action="append", default=None, help="the output is one of these strings (repeatable)"
    )
    constraint.add_argument("--json-object", action="store_true", default=None, help="any JSON object")
    parser.add_argument(
        "--cache-salt",
        type=salt,
        default=None,
        help="prefix caching shares KV blocks only between requests with the same salt (1..256 characters)",
    )
    parser.set_defaults(func=run)


def _bias_entry(text: str) -> tuple[int, float]:
    """``--logit-bias ID=BIAS`` as (token id, bias); argparse reports anything else (exit 2)."""
    token_id, equals, bias = text.partition("=")
    try:
        if not equals:
            raise ValueError(text)
        entry = int(token_id), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be ID=BIAS (an integer, a number), got {text!r}") from None
    if not 0 <= entry[0] <= INT32_MAX or not -MAX_LOGIT_BIAS <= entry[1] <= MAX_LOGIT_BIAS:
        raise argparse.ArgumentTypeError(
            f"must be ID=BIAS with ID >= 0 and BIAS in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {text!r}"
        )
    return entry


def build_request(args: argparse.Namespace) -> Any:
    """The GenerateRequest the flags describe."""
    from nanoserve.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(request_id=args.request_id, cache_salt=args.cache_salt or "")
    if args.chat or args.system is not None:
        messages = [pb.ChatMessage(role=pb.CHAT_ROLE_SYSTEM, content=args.system)] if args.system else []
        messages.append(pb.ChatMessage(role=pb.CHAT_ROLE_USER, content=args.prompt))
        request.chat.messages.extend(messages)
    else:
        request.prompt = args.prompt
    sampling = request.sampling
    for field in pb.SamplingParameters.DESCRIPTOR.fields:
        in_constraint = field.containing_oneof is not None and field.containing_oneof.name == "constraint"
        if not field.has_presence or in_constraint:
            continue
        value = getattr(args, field.name)
        if value is not None:
            setattr(sampling, field.name, value)
    for token_id, bias in args.logit_bias:
        sampling.logit_bias[token_id] = bias
    for name in ("json_schema", "regex", "grammar", "json_object"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    if args.choice is not None:
        sampling.choice.choices.extend(args.choice)
    sampling.min_tokens = args.min_tokens
    sampling.stop.extend(args.stop)
    sampling.stop_token_ids.extend(args.stop_token_id)
    sampling.ignore_eos = args.ignore_eos
    return request


def _file_text(path: str) -> str:
    """The text of a file named by a flag (argparse's ``type``): its error names the file."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None


def _finish_line(finish: Any) -> str:
    from nanoserve.v1 import generation_pb2 as pb

    reason = pb.FinishReason.Name(finish.reason).removeprefix("FINISH_REASON_").lower()
    if finish.reason == pb.FINISH_REASON_ABORT:
        reason += f" ({pb.AbortCause.Name(finish.abort_cause).removeprefix('ABORT_CAUSE_').lower()})"
    t = finish.timings
    return (
        f"[{reason}; {finish.usage.prompt_tokens} prompt ({finish.usage.cached_tokens} cached) + "
        f"{finish.usage.completion_tokens} completion tokens; "
        f"ttft {_seconds(t, 'ttft')}; total {_seconds(t, 'total_time')}]"
    )


def _seconds(timings: Any, field: str) -> str:
    """A Duration field of ``timings`` as seconds; '-' when unset (the request never got there)."""
    if not timings.HasField(field):
        return "-"
    return f"{getattr(timings, field).ToNanoseconds() / 1e9:.3f} s"


def error_lines(exc: Any, args: argparse.Namespace) -> str:
    """``error_line``, and below it what the user can do about it (``client.status_hint``), if anything."""
    from nanoserve.service.cli.client import status_hint

    hint = status_hint(exc.code(), exc.details() or "", args.server, token_given=bool(args.token))
    return error_line(exc) if hint is None else f"{error_line(exc)}\nhint: {hint}"


def error_line(exc: Any) -> str:
    """``error: CODE: details``, and the server's retry hint (google.rpc.RetryInfo) when it sent one."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    line = f"error: {exc.code().name}: {exc.details()}"
    status = rpc_status.from_call(exc)
    for detail in status.details if status is not None else ():
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(retry):
            line += f" (retry after {retry.retry_delay.ToNanoseconds() / 1e9:g} s)"
    return line


def run(args: argparse.Namespace) -> int:
    import grpc

    from nanoserve.service.cli.client import auth_metadata, open_channel, unready_hint, wait_ready
    from nanoserve.v1 import generation_pb2 as pb
    from nanoserve.v1 import generation_pb2_grpc

    request = build_request(args)
    num_samples = request.sampling.best_of or request.sampling.n or 1
    resumable = args.wait_ready > 0
    if resumable and not request.request_id:
        request.request_id = uuid.uuid4().hex
    with open_channel(args.server, tls=args.tls, ca_cert=args.ca_cert) as channel:
        if args.wait_ready > 0 and not wait_ready(channel, args.wait_ready):
            print(f"error: {args.server} not SERVING after {args.wait_ready:g} s", file=sys.stderr)
            _print_hint(unready_hint(channel, args.server))
            return 1
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        metadata = auth_metadata(args.token)
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        call: Any = stub.Generate(request, timeout=args.timeout, metadata=metadata)
        printer = StreamPrinter(
            args.json,
            samples=(request.sampling.n or 1) > 1,  # best_of > n = 1 returns one sample: printed as one
            note=_logprobs_note(request.sampling, args.json),
        )
        resuming = False  # the current call is a Resume
        while True:
            interrupt = CancelOnInterrupt(call)
            try:
                with interrupt:
                    for response in call:
                        printer.print(response)
                if interrupt.interrupted:
                    return interrupted_exit(printer)
                return EXIT_ABORTED if printer.aborted else 0
            except grpc.RpcError as exc:
                if interrupt.interrupted:  # the call ended because Ctrl-C cancelled it
                    return interrupted_exit(printer)
                if resuming and exc.code() == grpc.StatusCode.NOT_FOUND and printer.num_tokens == 0:
                    # the crash came before the journal held the request: nothing was sent, so send it again
                    print(
                        f"request {request.request_id} was not journaled before the crash; sent again", file=sys.stderr
                    )
                    resuming = False
                    call = stub.Generate(request, timeout=remaining_s(deadline), metadata=metadata)
                    continue
                if not (resumable and exc.code() == grpc.StatusCode.UNAVAILABLE):
                    printer.end_line()
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and printer.request_id and num_samples == 1:
                        # the stream was flowing: the server went away under it, and journaled the request
                        print(error_line(exc), file=sys.stderr)
                        _print_hint(_resume_hint(printer.request_id, printer.num_tokens))
                    else:
                        print(error_lines(exc, args), file=sys.stderr)
                    return 1
                # the text's line stays open: the resumed stream continues it, so stdout is the uninterrupted text
                # (on a terminal, where both streams meet, the message starts a line of its own)
                gap = "\n" if printer.line_open and sys.stderr.isatty() else ""
                print(f"{gap}{error_line(exc)}; waiting up to {args.wait_ready:g} s to resume", file=sys.stderr)
                if not wait_ready(channel, args.wait_ready):
                    printer.end_line()
                    print(f"error: {args.server} not SERVING again within {args.wait_ready:g} s", file=sys.stderr)
                    _print_hint(unready_hint(channel, args.server))
                    _print_hint(_resume_hint(request.request_id, printer.num_tokens))
                    return 1
                if num_samples > 1:  # Resume serves one-sample requests only: start the request over
                    refused = _abort_recovered(stub, request.request_id, metadata, deadline)
                    if refused is not None:
                        printer.end_line()
                        print(error_lines(refused, args), file=sys.stderr)
                        return 1
                    print(_sent_again_line(request, num_samples), file=sys.stderr)
                    printer.start_over()
                    call = stub.Generate(request, timeout=remaining_s(deadline), metadata=metadata)
                    resuming = False
                    continue
                print(
                    f"resuming request {request.request_id} after {printer.num_tokens} tokens (the server is back)",
                    file=sys.stderr,
                )
                resume = pb.ResumeRequest(request_id=request.request_id, after_token_index=printer.num_tokens)
                call = stub.Resume(resume, timeout=remaining_s(deadline), metadata=metadata)
                resuming = True
            except KeyboardInterrupt:  # Ctrl-C with no call streaming (waiting to resume): nothing to cancel
                return interrupted_exit(printer)


def _logprobs_note(sampling: Any, as_json: bool) -> str | None:
    """The note that plain output leaves out the logprobs asked for (said once the server took the request)."""
    if as_json:
        return None
    notes = [LOGPROBS_NOTE] if sampling.HasField("logprobs") else []
    notes += [PROMPT_LOGPROBS_NOTE] if sampling.HasField("prompt_logprobs") else []
    return "\n".join(notes) or None


def _print_hint(hint: str | None) -> None:
    if hint is not None:
        print(f"hint: {hint}", file=sys.stderr)


def _resume_hint(request_id: str, num_tokens: int) -> str | None:
    """How to get the rest of a stream the server's crash cut: the journal holds it."""
    if not request_id:
        return None
    after = f" --after-token {num_tokens}" if num_tokens else ""
    return (
        f"the server journals request {request_id}: once it is back, `nanoserve resume {request_id}{after}` "
        "prints the rest (generate --wait-ready SECONDS resumes by itself)"
    )


def _abort_recovered(stub: Any, request_id: str, metadata: Any, deadline: float | None) -> Any:
    """Aborts the server's recovered copy of a parallel request (which nobody could follow), so that
    sending it again neither runs it twice nor meets its id; None when done or when the server holds no
    such live request (not journaled before the crash, or ended since: NOT_FOUND), else the RpcError."""
    import grpc

    from nanoserve.v1 import generation_pb2 as pb

    try:
        stub.Abort(pb.AbortRequest(request_id=request_id), timeout=remaining_s(deadline), metadata=metadata)
    except grpc.RpcError as exc:
        return None if exc.code() == grpc.StatusCode.NOT_FOUND else exc
    return None


def _sent_again_line(request: Any, num_samples: int) -> str:
    """The one line that says a parallel request was started over after a crash, and whether its samples
    will be the ones already printed (seeded or greedy: the sampler draws each token from the seed and
    its position alone) or may differ."""
    sampling = request.sampling
    if sampling.HasField("seed"):
        same = f"seed {sampling.seed}: the same samples"
    elif sampling.HasField("temperature") and sampling.temperature == 0:
        same = "greedy: the same samples"
    else:
        same = "no --seed: the samples may differ"
    return (
        f"request {request.request_id} has {num_samples} samples, which Resume cannot continue (the journal keeps "
        f"no tokens of parallel samples): aborted it on the server and sent it again from its prompt ({same})"
    )


class CancelOnInterrupt:
    """While a call streams, Ctrl-C (SIGINT) cancels it and is remembered, instead of raising
    KeyboardInterrupt wherever the main thread is: inside grpc's locks that loses the interrupt
    (the stream runs on to its end) or breaks the lock ("cannot release un-acquired lock"),
    seen on a loaded machine. The server sees the cancel and aborts the request.

    interrupted: whether SIGINT came. The previous handler is back on exit, so Ctrl-C
    outside the block (waiting to resume) raises KeyboardInterrupt as usual.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self.interrupted = False
        self._installed = False
        self._previous: Any = None

    def __enter__(self) -> CancelOnInterrupt:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._installed:  # None: the previous handler was not set from Python; Python's own is the default
            signal.signal(signal.SIGINT, signal.default_int_handler if self._previous is None else self._previous)

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.interrupted = True
        # from another thread: the handler may run while this one holds the call's lock mid-update
        threading.Thread(target=self._call.cancel, name="cancel-on-interrupt", daemon=True).start()


def interrupted_exit(printer: StreamPrinter) -> int:
    """Ctrl-C's exit: the open line ended, nothing on stderr, 130 as shells report it."""
    printer.end_line()
    return EXIT_INTERRUPTED


def remaining_s(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (time.monotonic()); None without one."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class StreamPrinter:
    """Prints streamed messages; knows whether a line of text is left open."""

    def __init__(self, as_json: bool, samples: bool = False, note: str | None = None) -> None:
        self._as_json = as_json
        self._note = note  # said on stderr with the first message: only once the server took the request
        self.aborted = False  # a finish with reason abort came (a sample's, or the request's)
        self._samples: dict[int, str] | None = {} if samples else None  # index -> text so far (n / best_of)
        self._line_open = False  # text written since the last newline
        self.num_tokens = 0  # token ids received: where a resumed stream starts
        self.request_id = ""  # the request's id, as the server's messages give it (it may assign one)
        self.finish: Any = None  # the last Finish received

    def print(self, response: Any) -> None:
        from google.protobuf.json_format import MessageToDict

        from nanoserve.v1 import generation_pb2 as pb

        if self._note is not None:
            print(self._note, file=sys.stderr)
            self._note = None
        self.num_tokens += len(response.token_ids)
        self.request_id = response.request_id or self.request_id
        if response.HasField("finish"):
            self.finish = response.finish
        self.aborted = self.aborted or response.finish.reason == pb.FINISH_REASON_ABORT
        if self._as_json:
            message = MessageToDict(response, preserving_proto_field_name=True)
            if self._samples is not None:  # proto3 JSON leaves out a 0: sample 0's messages would have no index
                message.setdefault("index", 0)
            print(json.dumps(message), flush=True)
            if response.HasField("finish"):  # as in plain output: stdout stays one JSON object a line
                where = f"sample {response.index}: " if self._samples is not None else ""
                print(where + _finish_line(response.finish), file=sys.stderr)
            return
        if self._samples is not None:  # several samples: each is printed whole, under its index, when it ends
            self._samples[response.index] = self._samples.get(response.index, "") + response.text
            if response.HasField("finish"):
                print(f"--- sample {response.index} ---\n{self._samples.pop(response.index)}", flush=True)
                print(f"sample {response.index}: {_finish_line(response.finish)}", file=sys.stderr)
            return
        # marked before writing: a Ctrl-C between the two still ends the line
        self._line_open = self._line_open or bool(response.text)
        sys.stdout.write(response.text)
        sys.stdout.flush()
        if response.HasField("finish"):
            self.end_line()
            print(_finish_line(response.finish), file=sys.stderr)

    def start_over(self) -> None:
        """Forgets the partial samples and the token count: the request was sent again from its prompt."""
        if self._samples is not None:
            self._samples.clear()
        self.end_line()
        self.num_tokens = 0

    @property
    def line_open(self) -> bool:
        """Text was written since the last newline."""
        return self._line_open

    def end_line(self) -> None:
        """Ends the streamed text's line, if any text is on it."""
        if self._line_open:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self._line_open = False
