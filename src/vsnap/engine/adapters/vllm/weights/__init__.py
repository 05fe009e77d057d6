"""The model's weights as one flat file per rank, written at capture, streamed back at restore.

vLLM's own reload after sleep level 2 runs its model loader again: safetensors through pageable
copies and the model's weight-loading code, about 6 GB/s on an H200 (and in vLLM 0.26 it cannot
reload a LoRA-wrapped model at all). The file holds every tensor of the
sleep allocator's weights pool exactly as it sits on the GPU once loaded and processed (each
storage whole, in address order: parameters, quantization scales, LoRA slots; see pool_tensors),
so a restore only has to move bytes: by default the GPU copies them straight from the page cache,
page-locked piece by piece in place (dma_into); where CUDA refuses that, several threads read
pieces of the file into pinned host buffers and copy each to its tensor with an asynchronous
host-to-device copy while the next piece is read (buffered_into).

    layout      the file's layout: Segment, file_name, layout, fingerprint, storage_view
    copiers     the file into the tensors: stream_into, dma_into, buffered_into, LockedPages
    pool        vLLM's sleep allocator: pool_tensors, the CUDA graph pool, device_memory_report
    extension   WeightsFileExtension, vLLM's worker_extension_cls (EXTENSION names it); the stack limit
    references  weights by reference (opt-in, extension.BY_REFERENCE_ENV): the bytes the model's own
                safetensors hold are not written again; a Plan of extents says where each byte is
    safetensors_header   a .safetensors file's tensors, from its header read as hostile
    reference_copiers    a Plan into the tensors: stream_plan_into, dma_plan_into, buffered_plan_into

Nothing is re-exported: import the module that holds a name. vLLM imports extension (by its
qualified name) in every worker.
"""
