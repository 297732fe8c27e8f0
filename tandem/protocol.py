"""Messages between the HTTP process and the engine-core process: plain msgpack lists.

HTTP → core:  ["add", rid, prompt_ids, params, follows]   params = SamplingParams fields as a dict
              ["abort", rid] | ["pause"] | ["resume"] | ["shutdown"]
core → HTTP:  ["ready", info] | ["outputs", [output, ...], stats] | ["fatal", message]
              output = [rid, new_ids, finish_reason, error, cached_tokens, logprobs,
                        prompt_logprobs, error_kind]
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import msgpack

from tandem.sampling_params import SamplingParams


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False)


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    d = asdict(params)
    d["stop_token_ids"] = list(params.stop_token_ids)
    d["logit_bias"] = [list(p) for p in params.logit_bias]
    return d


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)
