"""Engine adapters: cpu (built in, PyTorch on CPU) and vllm (real vLLM on a CUDA GPU)."""
