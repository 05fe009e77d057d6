"""model.yaml: ``schema`` (strict pydantic models, the bounded YAML loader with line numbers, file
checks) and ``vllm_check`` (vLLM's argument rules run from the orchestrator, and the files those
arguments make the engine read). Imports vsnap.protocol, vsnap.host and the engine's rules."""
