"""Real vLLM as an engine adapter.

    adapter      VllmAdapter: AsyncLLM, sleep level 2, weight reload, vLLM's own OpenAI app
    compat       the one seam between vLLM versions: where the names that moved live
    serve_args   which arguments the user gave
    rules        the snapshot rules on vLLM's parsed serve arguments (the first stage)
    config_rules the snapshot rules on vLLM's resolved config: the model (the second stage)
    tp           the tensor-parallel worker methods
    weights/     the worker extension: the weights file written at capture, streamed back at restore

Nothing here is imported until the launcher asks for the "vllm" engine: vLLM is optional.
"""
