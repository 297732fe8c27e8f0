"""Tandem: an LLM inference engine on MLX with two lazy forward steps in flight."""

from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the runner (and so mlx); import it only when asked for.
    if name == "LLM":
        from tandem.llm import LLM

        return LLM
    raise AttributeError(name)
