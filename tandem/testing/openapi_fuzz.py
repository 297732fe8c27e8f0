"""Property-based HTTP fuzzing of a live server from its own /openapi.json (schemathesis).

Two phases per operation: schemathesis's *coverage* cases (deterministic: boundary values,
each field missing / of a wrong type / just out of range, unexpected HTTP methods), then
*fuzzing* (hypothesis: random bodies that match the schema, and bodies that violate it).
POST /pause and /resume are left out (they stop scheduling).

Every response is checked: no status >= 500, no dropped connection or timeout, every error
is an OpenAI error body, a stream has no error event and ends with ``data: [DONE]`` (unless
the fuzzer hung up early, which it does after a few events: that exercises disconnects),
and the status, content type and JSON body match the schema's responses. After the run
/health must be 200, the server process alive and its memory (RSS of the server process and
its children) within a bound of what it was after a warm-up.

Long run (prints a JSON summary; exit status 1 on any failure)::

    .venv/bin/python -m tandem.testing.openapi_fuzz --examples 5000 --seed 1

Cases a schema-violating (negative) body got a 2xx for are reported as ``accepted_invalid``
and schema-conforming (positive) bodies that got a 4xx as ``rejected_valid`` (by the error's
``param``): information about how close the schema is to the server, not failures (the schema
cannot express the context length or cross-field rules).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tandem.testing.live_server import process_tree_rss
from tandem.testing.openapi_fuzz_setup import narrow, warm_up
from tandem.testing.response_checks import check_error_body, check_event_stream

MIB = 1 << 20
# Operations with side effects on every other request: not fuzzed.
SKIPPED = ["/pause", "/resume"]
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
# Settings that keep every accepted request short on a tiny model: a huge max_tokens is a 400
# (context length), and chat without max_tokens generates 16 tokens.
SERVER_ARGS = ("--max-model-len", "256", "--default-max-tokens", "16")
MAX_EXAMPLES_KEPT = 30  # failing / notable requests kept per kind in the summary
BODY_CHARS = 600


def _dump(value: Any) -> str:
    from schemathesis.core import NotSet

    if isinstance(value, NotSet):
        return ""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= BODY_CHARS else text[:BODY_CHARS] + f"... ({len(text)} chars)"


@dataclass
class FuzzRun:
    """Sends cases to a live server and records what came back."""

    url: str
    headers: dict[str, str]
    timeout: float = 60.0
    requests: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    by_operation: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    by_phase: Counter[str] = field(default_factory=Counter)
    failures: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    failure_counts: Counter[str] = field(default_factory=Counter)
    accepted_invalid: list[dict[str, Any]] = field(default_factory=list)
    accepted_invalid_count: int = 0
    rejected_valid: Counter[str] = field(default_factory=Counter)
    rejected_valid_example: dict[str, dict[str, str]] = field(default_factory=dict)
    streams_cut_short: int = 0
    slowest_s: float = 0.0
    server_gone: bool = False

    def __post_init__(self) -> None:
        import requests

        self.session = requests.Session()

    def _record(
        self, kind: str, case: Any, mode: str, phase: str, status: Any, detail: str
    ) -> None:
        self.failure_counts[kind] += 1
        if len(self.failures[kind]) < MAX_EXAMPLES_KEPT:
            self.failures[kind].append(
                {
                    "request": f"{case.method} {case.formatted_path}",
                    "media_type": case.media_type,
                    "body": _dump(case.body),
                    "mode": mode,
                    "phase": phase,
                    "status": status,
                    "detail": detail[:BODY_CHARS],
                }
            )

    def send(self, case: Any, phase: str) -> None:
        import requests
        from schemathesis import checks
        from schemathesis.core.failures import Failure, FailureGroup

        if self.server_gone:
            return
        meta = case.meta
        mode = meta.generation.mode.value if meta is not None else "positive"
        label = f"{case.method} {case.operation.path}"
        self.requests += 1
        self.by_phase[phase] += 1
        start = time.monotonic()
        try:
            response = case.call(
                base_url=self.url, session=self.session, headers=self.headers, timeout=self.timeout
            )
        except requests.RequestException as e:
            self.statuses["no response"] += 1
            self._record("no_response", case, mode, phase, None, f"{type(e).__name__}: {e}")
            if not self.healthy():
                self.server_gone = True
            return
        finally:
            self.slowest_s = max(self.slowest_s, time.monotonic() - start)
        status = response.status_code
        self.statuses[str(status)] += 1
        self.by_operation[label][f"{mode} {status}"] += 1
        if status >= 500:
            detail = response.content.decode("utf-8", "replace")
            self._record("server_error", case, mode, phase, status, detail)
        elif status >= 400:
            problem = check_error_body(response.content, case.operation.path)
            if problem is not None:
                detail = f"{problem}: {response.content[:300]!r}"
                self._record("error_shape", case, mode, phase, status, detail)
            elif mode == "positive" and case.method == "POST":
                err = json.loads(response.content)["error"]
                param = f"{case.operation.path} {err.get('param')}"
                self.rejected_valid[param] += 1
                self.rejected_valid_example.setdefault(
                    param, {"message": err["message"][:200], "body": _dump(case.body)}
                )
        content_type = response.headers.get("content-type", [""])[0]
        if status == 200 and content_type.startswith("text/event-stream"):
            self.streams_cut_short += response.stream_cut_short
            problem = check_event_stream(
                response.content, response.stream_cut_short, case.operation.path
            )
            if problem is not None:
                self._record("stream", case, mode, phase, status, problem)
        if status < 500:  # schema honesty: what came back is what /openapi.json says
            try:
                case.validate_response(
                    response,
                    checks=[
                        checks.status_code_conformance,
                        checks.content_type_conformance,
                        checks.response_schema_conformance,
                    ],
                )
            except (FailureGroup, Failure) as e:
                failures = e.exceptions if isinstance(e, FailureGroup) else [e]
                for f in failures:
                    self._record("schema", case, mode, phase, status, f"{f.title}: {f.message}")
        if mode == "negative" and 200 <= status < 300:
            try:
                case.validate_response(response, checks=[checks.negative_data_rejection])
            except (FailureGroup, Failure):
                self.accepted_invalid_count += 1
                if len(self.accepted_invalid) < MAX_EXAMPLES_KEPT:
                    what = meta.phase.data.description if meta is not None else None
                    self.accepted_invalid.append(
                        {"request": label, "invalid": what, "body": _dump(case.body)}
                    )

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False


def _operations(schema: Any) -> Iterator[Any]:
    for result in schema.get_all_operations():
        yield result.ok()


def run_coverage(run: FuzzRun, schema: Any) -> None:
    """schemathesis's deterministic coverage cases, positive and negative, for every operation."""
    from schemathesis import GenerationMode

    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    for op in _operations(schema):
        config = schema.config.generation_for(operation=op, phase="coverage")
        for case in schema.iter_coverage_cases(
            op, generation_modes=modes, generation_config=config
        ):
            if run.server_gone:
                return
            run.send(case, "coverage")


class _ServerGone(Exception):
    """Ends a hypothesis run early: the server is gone, nothing more can be tested."""


def run_fuzzing(run: FuzzRun, schema: Any, examples: int, seed: int) -> None:
    """``examples`` hypothesis examples, split over the generation operations x {positive,
    negative}; the GET operations (no inputs) get a few positive ones."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, Verbosity
    from schemathesis import GenerationMode

    jobs: list[tuple[Any, GenerationMode, int]] = []
    for op in _operations(schema):
        if op.path in GENERATION_PATHS:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                jobs.append((op, mode, max(1, examples // (2 * len(GENERATION_PATHS)))))
        elif op.method.upper() == "POST":  # cheap bodies (tokenizer endpoints)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                jobs.append((op, mode, max(1, examples // 20)))
        else:
            jobs.append((op, GenerationMode.POSITIVE, 3))
    for i, (op, mode, n) in enumerate(jobs):
        strategy = op.as_strategy(generation_mode=mode, headers=run.headers)

        @hypothesis.settings(
            max_examples=n,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
            print_blob=False,
        )
        @hypothesis.seed(seed + i)
        @hypothesis.given(case=strategy)
        def one(case: Any) -> None:
            if run.server_gone:
                raise _ServerGone
            run.send(case, "fuzzing")

        try:
            one()
        except _ServerGone:
            return


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / MIB, 1)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def fuzz(
    url: str,
    *,
    api_key: str | None,
    examples: int,
    seed: int = 0,
    server_pid: int | None = None,
    vocab_size: int | None = None,
    coverage: bool = True,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Fuzz the server at ``url``; returns the JSON-able summary (``failures`` empty if all
    checks passed). ``server_pid``: measure the RSS of that process tree. ``vocab_size``:
    the model's, to keep most generated prompt token ids valid (``narrow``)."""
    import schemathesis

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.monotonic()
    warm_up(url, headers)
    rss_warm = sum(process_tree_rss(server_pid).values()) if server_pid else None
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        document = client.get("/openapi.json").raise_for_status().json()
        models = client.get("/v1/models").raise_for_status().json()["data"]
    max_model_len = models[0].get("max_model_len") if models else None
    document = narrow(document, vocab_size=vocab_size, max_model_len=max_model_len)
    schema = schemathesis.openapi.from_dict(document).exclude(path=SKIPPED)
    run = FuzzRun(url, headers, timeout=timeout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hypothesis / schemathesis notes on regex dialects
        if coverage:
            run_coverage(run, schema)
        if examples > 0:
            run_fuzzing(run, schema, examples, seed)
    healthy = run.healthy()
    alive = server_pid is None or Path(f"/proc/{server_pid}").exists()
    rss_after = sum(process_tree_rss(server_pid).values()) if server_pid else None
    failures, counts = dict(run.failures), dict(run.failure_counts)
    if not healthy:
        failures["unhealthy_after"] = [{"detail": "/health is not 200 after the run"}]
        counts["unhealthy_after"] = 1
    if not alive:
        failures["dead_after"] = [{"detail": f"server process {server_pid} is gone"}]
        counts["dead_after"] = 1
    return {
        "url": url,
        "seed": seed,
        "examples": examples,
        "requests": run.requests,
        "stopped_early": run.server_gone,  # the server went away: nothing more was sent
        "by_phase": dict(run.by_phase),
        "seconds": round(time.monotonic() - started, 1),
        "slowest_request_s": round(run.slowest_s, 2),
        "status_counts": dict(sorted(run.statuses.items())),
        "server_errors": sum(n for s, n in run.statuses.items() if s.isdigit() and int(s) >= 500),
        "by_operation": {k: dict(sorted(v.items())) for k, v in sorted(run.by_operation.items())},
        "streams_cut_short": run.streams_cut_short,
        "failure_counts": counts,
        "failures": failures,
        "accepted_invalid": {"count": run.accepted_invalid_count, "examples": run.accepted_invalid},
        "rejected_valid": [
            {"param": param, "count": n, **run.rejected_valid_example[param]}
            for param, n in run.rejected_valid.most_common()
        ],
        "health_after": healthy,
        "alive_after": alive,
        "rss_warm_mib": _mib(rss_warm),
        "rss_after_mib": _mib(rss_after),
        "rss_growth_mib": _mib(rss_after - rss_warm) if rss_warm and rss_after else None,
    }


def fuzz_fresh_server(
    model: Path | None,
    *,
    examples: int,
    seed: int = 0,
    coverage: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Start ``tandem serve`` (a tiny random-weight model unless ``model``), fuzz it, stop it;
    the summary also has the server's exit code and its log lines with 'Traceback'."""
    from tandem.testing.live_server import API_KEY, Server

    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from tandem.testing.tiny_models import make_tiny_model

            model = make_tiny_model(Path(tmp) / "llama", "llama")
        config = Path(model) / "config.json"
        vocab_size = json.loads(config.read_text()).get("vocab_size") if config.exists() else None
        server = Server(model, *SERVER_ARGS)
        try:
            if log:
                log(f"fuzzing {server.url} (pid {server.proc.pid})")
            summary = fuzz(
                server.url,
                api_key=API_KEY,
                examples=examples,
                seed=seed,
                server_pid=server.proc.pid,
                vocab_size=vocab_size,
                coverage=coverage,
            )
        finally:
            code = server.stop()
    summary["server_exit_code"] = code
    summary["server_tracebacks"] = sum("Traceback" in line for line in server.log)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.testing.openapi_fuzz", description=__doc__)
    p.add_argument("--examples", type=int, default=2000, help="hypothesis examples (total)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="model folder (default: a tiny random model)")
    p.add_argument("--url", help="fuzz this running server instead of starting one")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    p.add_argument("--vocab-size", type=int, help="with --url: the model's vocabulary size")
    p.add_argument("--no-coverage", action="store_true", help="skip the coverage phase")
    p.add_argument("--rss-bound-mib", type=float, default=200.0)
    p.add_argument("--out", type=Path, help="also write the summary here")
    args = p.parse_args(argv)
    coverage = not args.no_coverage
    if args.url:
        summary = fuzz(
            args.url.rstrip("/"),
            api_key=args.api_key,
            examples=args.examples,
            seed=args.seed,
            server_pid=args.pid,
            vocab_size=args.vocab_size,
            coverage=coverage,
        )
    else:
        summary = fuzz_fresh_server(
            args.model, examples=args.examples, seed=args.seed, coverage=coverage, log=_log
        )
    growth = summary["rss_growth_mib"]
    summary["rss_bound_mib"] = args.rss_bound_mib
    summary["ok"] = not summary["failures"] and (growth is None or growth <= args.rss_bound_mib)
    text = json.dumps(summary, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
