"""``RequestIntake``: the work on a request before the engine thread sees it, off the event loop.

Tokenizing, chat templating and validating run on one tokenizer thread, one request at a
time, in arrival order; a constrained request's grammar then compiles on the grammar
compiler's threads, so a slow compile holds up no other request's tokenizing. ``tokenize``
and ``tokenizer_files`` (the Tokenize and GetTokenizer calls) share the tokenizer thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.engine.core.llm_engine import LLMEngine
    from nanoserve.engine.core.request import Request
    from nanoserve.engine.sampling.params import SamplingParams
    from nanoserve.engine.text.prompts import ChatPrompt, Prompt


class RequestIntake:
    """The tokenizer thread of one engine, and the steps a request takes on it.

    core: returns the engine (it is built after this object, at start) and raises when there is none.
    """

    def __init__(self, core: Callable[[], LLMEngine]) -> None:
        self._core = core
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-tokenize")

    async def process(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None, arrival_time: float
    ) -> Request:
        """The request tokenized and validated (``LLMEngine.process_request``), its grammar's matcher
        attached once compiled. Raises InvalidRequestError naming the field and the limit."""
        loop = asyncio.get_running_loop()
        process = functools.partial(self._core().process_request, attach_grammar=False)
        request = await loop.run_in_executor(self._pool, process, request_id, prompt, params, arrival_time)
        constraint = request.sampling_params.constraint
        if constraint is not None:
            request.attach_matcher(await loop.run_in_executor(None, self._core().grammars.matcher, constraint))
        return request

    async def tokenize(self, prompt: str | ChatPrompt) -> list[int]:
        """Token ids of a text, or of chat messages rendered with the chat template. Raises
        InvalidRequestError (field ``text`` or ``messages``), see ``AsyncLLMEngine.tokenize``."""
        tokenize = functools.partial(self._core().input_processor.tokenize, prompt, text_field="text", as_prompt=False)
        _, token_ids = await asyncio.get_running_loop().run_in_executor(self._pool, tokenize)
        return token_ids

    async def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer as files (``Tokenizer.export_files``: file name -> content)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._core().tokenizer.export_files)

    def shutdown(self) -> None:
        """Stops the tokenizer thread once its current work ends; queued work is not started."""
        self._pool.shutdown(wait=False)
