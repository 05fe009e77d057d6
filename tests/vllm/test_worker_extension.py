"""vsnap's worker extension against this vLLM's GPU Worker, into which vLLM mixes it.

vLLM asserts, when each worker starts, that the extension brings no attribute its Worker class
already has; a vLLM that adds one of vsnap's names would fail at the first GPU boot. Here it is
checked on every vLLM version CI installs (0.33 added `_compile_or_warm_up_model` and
`get_simple_cpu_offload_num_cpu_blocks` to the Worker, 0.32 `checkpoint_prepare`).
"""

from __future__ import annotations

import pytest

from vsnap.engine.adapters.vllm.weights import extension as weights_extension


def test_vsnaps_extension_adds_no_name_vllms_worker_has() -> None:
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception as exc:  # an environment whose GPU worker cannot import without CUDA
        pytest.skip(f"vLLM's GPU worker does not import here: {type(exc).__name__}: {exc}")
    extension = weights_extension.WeightsFileExtension
    assert weights_extension.EXTENSION.endswith(extension.__name__)
    names = [name for name in dir(extension) if not name.startswith("__")]
    assert names and [name for name in names if hasattr(Worker, name)] == []
