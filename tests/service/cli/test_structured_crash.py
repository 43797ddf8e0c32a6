"""A constrained stream across a SIGKILL (issue 33): ``nanoserve serve`` is killed mid-stream, restarted
on the same log, recovers the request under the same grammar (the journal keeps the constraint), and
``nanoserve generate --wait-ready`` resumes it: the tokens equal an uninterrupted run's, and the text
validates against the schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema

from ...faults import free_port
from .test_journal_crash import Server, read_rest, serve_command
from .test_serve_log_faults import clean_env

SCHEMA = {
    "type": "object",
    "properties": {
        "story": {"type": "string", "minLength": 10, "maxLength": 40},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["story", "n"],
    "additionalProperties": False,
}


def test_a_sigkilled_constrained_stream_resumes_under_the_same_grammar(tiny_model_dir: Path, tmp_path: Path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    url = f"sqlite:///{tmp_path / 'log.db'}"
    port = free_port()
    command = serve_command(url, tiny_model_dir, "structured", port)
    flags = ["--max-tokens", "200", "--temperature", "0", "--json-schema", str(schema_file)]
    generate = [sys.executable, "-m", "nanoserve.service.cli.main", "generate", "A story:", *flags]
    generate += ["--server", f"127.0.0.1:{port}", "--json"]
    server = Server(command)
    cli = subprocess.Popen(
        [*generate, "--wait-ready", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    assert cli.stdout is not None
    lines = [cli.stdout.readline() for _ in range(3)]  # a few tokens have been streamed: mid-JSON
    server.kill()
    server = Server(command)
    out, err = read_rest(cli, 120)
    uninterrupted = subprocess.run(generate, capture_output=True, text=True, env=clean_env(), timeout=120, check=True)
    server.stop()
    assert cli.returncode == 0, err
    assert "resuming request" in err
    resumed = [json.loads(line) for line in lines + out.splitlines() if line.strip()]
    expected = [json.loads(line) for line in uninterrupted.stdout.splitlines() if line.strip()]
    token_ids = [t for m in resumed for t in m.get("token_ids", [])]
    assert token_ids == [t for m in expected for t in m.get("token_ids", [])]
    assert resumed[-1]["finish"]["reason"] == expected[-1]["finish"]["reason"] == "FINISH_REASON_STOP"
    jsonschema.validate(json.loads("".join(m.get("text", "") for m in resumed)), SCHEMA)
