"""The compiler vLLM calls: ``compilation_config.backend`` = ``"graphpass.integrations.vllm.backend.vllm_backend"``.

vLLM resolves that name in each worker and gives the function to ``torch.compile``. It compiles with
``graphpass.backend(**options)``, the ``options`` of ``additional_config["graphpass"]``, read from the
vLLM config current while vLLM compiles (vLLM sets it around compilation); without one, graphpass's
defaults.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from .config import parse

log = logging.getLogger("graphpass.integrations.vllm")


def _options() -> dict:
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        log.warning("graphpass compiles for vLLM without a current vLLM config: graphpass's default options")
        return {}
    settings = parse(vllm_config.additional_config)
    return dict(settings.options) if settings is not None else {}


def vllm_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """``torch.compile`` backend for vLLM: ``graphpass.backend(**options)(gm, example_inputs)``."""
    from ...dynamo_backend import backend

    return backend(**_options())(gm, example_inputs)
