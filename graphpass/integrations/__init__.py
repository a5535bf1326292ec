"""Integrations of graphpass into serving engines (loaded by the engine through its plugin entry points).

- :mod:`graphpass.integrations.vllm`: the vLLM plugin (``vllm.general_plugins`` entry point), docs/vllm.md.
"""
