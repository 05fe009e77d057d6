"""Tensor parallelism (docs/design/tensor-parallel-2.md) without GPUs: the worker helpers over
fakes (vllm_tp), the adapter's order of calls and its per-rank results over a fake engine, and
the orchestrator's GPU choice at capture, environment and device-file check."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import weakref
from types import SimpleNamespace
from typing import Any

import pytest

from vsnap.engine.adapters.vllm import rules as vllm_rules
from vsnap.engine.adapters.vllm import serve_args as vllm_serve_args
from vsnap.engine.adapters.vllm import tp as vllm_tp

# --- the worker side (vllm_tp) ------------------------------------------------------------------

def test_the_sentinel_fails_loudly_but_lets_vllm_shut_down() -> None:
    comm = vllm_tp.Disconnected("tp:0", 2)
    assert comm.disabled is False and comm.available is True and comm.world_size == 2
    comm.destroy()  # vLLM's shutdown calls it
    with pytest.raises(RuntimeError, match=r"NCCL of group tp:0 is disconnected for a checkpoint \(used: all_reduce\)"):
        comm.all_reduce(None)
    with pytest.raises(AttributeError):  # copy and pickle probe dunders: plain absences
        comm.__deepcopy__  # noqa: B018
    assert not hasattr(comm, "__getstate_unknown__")


class Group:
    def __init__(self, name: str, dc: Any, world_size: int = 2) -> None:
        self.unique_name, self.device_communicator, self.world_size = name, dc, world_size


def test_the_group_walk_takes_live_groups_with_a_device_communicator() -> None:
    tp = Group("tp:0", SimpleNamespace(pynccl_comm=object()))
    world = Group("world", None, world_size=2)  # vLLM's world group has no device communicator
    pp = Group("pp:0", None, world_size=1)
    gone = Group("ep:0", SimpleNamespace())
    groups = {g.unique_name: weakref.ref(g) for g in (tp, world, pp, gone)}
    del gone
    import gc

    gc.collect()
    assert vllm_tp.comm_groups(groups) == [("tp:0", tp)]
    assert vllm_tp.comm_groups({}) == []  # one rank: nothing to disconnect


def test_what_cannot_be_rebuilt_is_named() -> None:
    clean = SimpleNamespace(pynccl_comm=object(), ca_comm=None, symm_mem_comm=None, fi_ar_comm=None,
                            all2all_manager=None)
    assert vllm_tp.unsupported_state("tp:0", clean, SimpleNamespace(_fi_ar_workspace=None),
                                     SimpleNamespace(_registered_base_addrs={})) == []
    assert vllm_tp.unsupported_state("tp:0", SimpleNamespace(ca_comm=SimpleNamespace(disabled=True))) == []
    dirty = SimpleNamespace(ca_comm=SimpleNamespace(disabled=False), symm_mem_comm=object(), fi_ar_comm=object(),
                            all2all_manager=object())
    reasons = vllm_tp.unsupported_state("tp:0", dirty, SimpleNamespace(_fi_ar_workspace=object()),
                                        SimpleNamespace(_registered_base_addrs={b"k": {1}}))
    assert [r.split(";")[0] for r in reasons] == [
        "tp:0: custom all-reduce is on (CUDA IPC buffers)", "tp:0: torch symmetric memory holds a mapped buffer",
        "tp:0: FlashInfer all-reduce holds an IPC workspace",
        "tp:0: an all-to-all manager holds peer buffers (expert parallelism)",
        "FlashInfer's _fi_ar_workspace exists (the all-reduce + RMSNorm fusion)",
        "memory is registered with NCCL (NCCL symmetric memory)"]


def test_the_deadline_returns_raises_and_times_out() -> None:
    assert vllm_tp.call_with_deadline(lambda: 7, 5, "seven") == 7
    with pytest.raises(KeyError):
        vllm_tp.call_with_deadline(lambda: {}["x"], 5, "lookup")
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError, match="ncclCommAbort of group tp:0 did not return within 0 s"):
            vllm_tp.call_with_deadline(release.wait, 0.1, "ncclCommAbort of group tp:0")
    finally:
        release.set()


def test_destroy_comm_aborts_and_fails_closed_on_a_hung_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    import torch

    monkeypatch.setattr(torch.accelerator, "device_index", lambda index: contextlib.nullcontext(), raising=False)
    aborted = []
    comm = SimpleNamespace(available=True, disabled=False, device=SimpleNamespace(index=0), comm="handle",
                           nccl=SimpleNamespace(ncclCommAbort=aborted.append))
    vllm_tp.destroy_comm("tp:0", comm, deadline_s=5)
    assert aborted == ["handle"] and (comm.available, comm.disabled) == (False, True)
    vllm_tp.destroy_comm("tp:0", comm, deadline_s=5)  # already destroyed (or one rank): nothing to do
    assert aborted == ["handle"]
    release = threading.Event()
    hung = SimpleNamespace(available=True, disabled=False, device=SimpleNamespace(index=0), comm="h",
                           nccl=SimpleNamespace(ncclCommAbort=lambda handle: release.wait()))
    try:
        with pytest.raises(TimeoutError, match="a CUDA graph may still hold it"):
            vllm_tp.destroy_comm("tp:0", hung, deadline_s=0.1)
        assert hung.available is True  # not marked destroyed: the disconnect fails
    finally:
        release.set()


class FakeNccl:
    def __init__(self, initialised: bool | None) -> None:
        self.initialised = initialised
        if initialised is not None:
            self._is_initialized = lambda: self.initialised


class FakePG:
    def __init__(self, name: str, backend: Any) -> None:
        self.group_name, self.backend = name, backend

    def _get_backend(self, device: Any) -> Any:
        if self.backend is None:
            raise RuntimeError("no backend for cuda")
        return self.backend


def test_torch_nccl_groups_must_never_have_made_a_communicator() -> None:
    groups = [FakePG("0", FakeNccl(False)), FakePG("1", FakeNccl(True)), FakePG("gloo", None),
              FakePG("other", object())]
    assert vllm_tp.initialised_torch_nccl(groups, "cuda", FakeNccl) == (["1"], True)
    assert vllm_tp.initialised_torch_nccl([FakePG("0", FakeNccl(None))], "cuda", FakeNccl) == ([], False)
    assert vllm_tp.initialised_torch_nccl(groups, "cuda", None) == ([], True)  # a torch without NCCL


class FakeDriver:
    """cuDevice*/cuCtx* over a set of GPUs where this process holds primary contexts."""

    def __init__(self, count: int, contexts: set[int], peer_on: set[int]) -> None:
        self.count, self.contexts, self.peer_on = count, contexts, peer_on
        self.retained: list[int] = []

    def cuDeviceGetCount(self):
        return 0, self.count

    def cuDeviceGet(self, index: int):
        return 0, index

    def cuDevicePrimaryCtxGetState(self, device: int):
        return 0, 0, device in self.contexts

    def cuDevicePrimaryCtxRetain(self, device: int):
        self.retained.append(device)
        return 0, f"ctx{device}"

    def cuDevicePrimaryCtxRelease(self, device: int):
        self.retained.remove(device)
        return (0,)

    def cuCtxDisablePeerAccess(self, context: str):
        return (0,) if int(context[3:]) in self.peer_on else (704,)  # CUDA_ERROR_PEER_ACCESS_NOT_ENABLED


def test_peer_access_is_turned_off_only_where_a_context_exists() -> None:
    driver = FakeDriver(4, contexts={0, 1, 3}, peer_on={1})
    assert vllm_tp.disable_peer_access(driver, 0) == {"peer_access_was_on": [1], "other_gpu_contexts": [1, 3]}
    assert driver.retained == []  # every retain released; GPU 2 (no context) never touched
    assert vllm_tp.disable_peer_access(FakeDriver(1, {0}, set()), 0) == {"peer_access_was_on": [],
                                                                          "other_gpu_contexts": []}


def test_drop_cuda_graphs_clears_the_wrappers_and_the_v2_manager() -> None:
    cleared = []
    wrapper = SimpleNamespace(clear_all_graphs=lambda: cleared.append("wrapper"))
    manager = SimpleNamespace(graphs={"d1": 1, "d2": 2}, _graphs_captured=True)
    assert vllm_tp.drop_cuda_graphs(SimpleNamespace(cudagraph_manager=manager, speculator=None), [wrapper]) == 2
    assert cleared == ["wrapper"] and manager.graphs == {} and manager._graphs_captured is False
    assert vllm_tp.drop_cuda_graphs(SimpleNamespace(), [wrapper]) == 0  # the V1 runner: wrappers only
    with pytest.raises(RuntimeError, match="the speculator captures CUDA graphs of its own"):
        vllm_tp.drop_cuda_graphs(SimpleNamespace(speculator=SimpleNamespace(cudagraph_manager=object())), [])


def test_the_tensor_parallel_methods_are_in_vsnaps_one_worker_extension() -> None:
    from vsnap.engine.adapters.vllm.weights import extension as weights_extension

    assert issubclass(weights_extension.WeightsFileExtension, vllm_tp.TensorParallelExtension)
    assert vllm_rules.VSNAP_WORKER_EXTENSION == weights_extension.EXTENSION  # the name specs and images carry
    names = [n for n in vars(vllm_tp.TensorParallelExtension) if not n.startswith("__")]
    assert names and all(n.startswith("vsnap_") for n in names)  # vLLM refuses a clash with the Worker's


def test_the_worker_extension_name_is_the_class_qualified_name() -> None:
    """The string the engine gives vLLM (and a spec may repeat) names the class where it lives:
    vLLM imports the module and takes the class by that name in every worker."""
    import importlib

    from vsnap.engine.adapters.vllm.weights import extension as weights_extension

    cls = weights_extension.WeightsFileExtension
    assert f"{cls.__module__}.{cls.__qualname__}" == vllm_rules.VSNAP_WORKER_EXTENSION == weights_extension.EXTENSION
    module, name = vllm_rules.VSNAP_WORKER_EXTENSION.rsplit(".", 1)  # as vLLM's resolve_obj_by_qualname
    assert getattr(importlib.import_module(module), name) is cls


# --- the adapter over a fake engine -------------------------------------------------------------

class FakeEngine:
    """collective_rpc answers every rank; each call is recorded with its timeout."""

    def __init__(self, ranks: int, answers: dict[str, Any] | None = None) -> None:
        self.ranks, self.answers, self.calls = ranks, answers or {}, []

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[Any]:
        self.calls.append((method, timeout))
        answer = self.answers.get(method, {})
        return [answer(rank) if callable(answer) else answer for rank in range(self.ranks)]

    async def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    async def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tuple(tags)))


def adapter(ranks: int, recapture: bool, engine: FakeEngine) -> Any:
    from vsnap.engine.adapters.vllm import adapter as vllm
    from vsnap.engine.adapters.vllm.weights import extension as weights_extension

    a = vllm.VllmAdapter(SimpleNamespace(weights_dir=None))
    a.engine, a.tp, a.recapture = engine, ranks, recapture
    a.args = SimpleNamespace(worker_extension_cls=weights_extension.EXTENSION)
    return a


def test_merge_ranks() -> None:
    from vsnap.engine.adapters.vllm.adapter import merge_ranks

    assert merge_ranks([]) == {}
    assert merge_ranks([{"a_s": 1.0, "x": "same"}]) == {"a_s": 1.0, "x": "same"}  # one rank: as it is
    assert merge_ranks([{"load_s": 1.0, "weights_bytes": 10.0, "weights_gb_per_s": 2.0, "x": "same", "y": "a"},
                        {"load_s": 3.0, "weights_bytes": 20.0, "weights_gb_per_s": 3.0, "x": "same", "y": "b"}]) == {
        "load_s": 3.0, "weights_bytes": 30.0, "weights_gb_per_s": 5.0, "x": "same", "y": "rank0 a; rank1 b"}


def test_sleep_disconnects_first_and_wake_rebuilds_last() -> None:
    from vsnap.engine.adapters.vllm import adapter as vllm

    engine = FakeEngine(2, {"vsnap_tp_reconnect": lambda r: {"nccl_init_s": 0.2 + r, "comms_reconnected": 1.0},
                            "vsnap_recapture_graphs": {"graph_capture_s": 4.0, "graph_bytes": 1e9},
                            "vsnap_tp_disconnect": {"graphs_dropped": 3.0, "disconnect_s": 0.1}})
    a = adapter(2, True, engine)
    asyncio.run(a._sleep())
    times = asyncio.run(a._wake(None))
    assert [c[0] for c in engine.calls] == [
        "vsnap_unlock_weights_file", "vsnap_tp_disconnect", "vsnap_before_sleep", "sleep", "vsnap_release_memory",
        "vsnap_restore_stack_limit", "wake_up", "reload_weights", "wake_up", "vsnap_tp_reconnect",
        "vsnap_recapture_graphs"]
    timeouts = dict(engine.calls)
    assert timeouts["vsnap_tp_disconnect"] == vllm.DISCONNECT_TIMEOUT_S
    assert timeouts["vsnap_tp_reconnect"] == vllm.RECONNECT_TIMEOUT_S
    assert timeouts["vsnap_recapture_graphs"] == vllm.RECAPTURE_TIMEOUT_S
    assert times["nccl_init_s"] == 1.2 and times["graph_capture_s"] == 4.0  # the slowest rank


def test_one_rank_without_the_opt_in_calls_exactly_what_it_did() -> None:
    engine = FakeEngine(1)
    a = adapter(1, False, engine)
    asyncio.run(a._sleep())
    times = asyncio.run(a._wake(None))
    # the weights file unlocked before the sleep, the stack limit put back before the wake: nothing of NCCL
    assert [c[0] for c in engine.calls] == ["vsnap_unlock_weights_file", "vsnap_before_sleep", "sleep",
                                            "vsnap_release_memory", "vsnap_restore_stack_limit", "wake_up",
                                            "reload_weights", "wake_up"]
    assert "nccl_init_s" not in times and "graph_capture_s" not in times


def test_every_rank_file_must_be_there_and_fingerprints_name_the_rank(tmp_path, capsys) -> None:
    from vsnap.engine.adapters.vllm.weights import layout as weights_layout

    a = adapter(2, True, FakeEngine(2, {"vsnap_fingerprint": lambda r: {"parameter w": 10 + r}}))
    a.weights_source = "file"
    (tmp_path / weights_layout.file_name(0)).write_bytes(b"x")
    assert a._weights_file_visible(str(tmp_path)) is False
    assert "rank1.bin of" in capsys.readouterr().out
    (tmp_path / weights_layout.file_name(1)).write_bytes(b"x")
    assert a._weights_file_visible(str(tmp_path)) is True
    assert asyncio.run(a._fingerprint()) == {"rank0 parameter w": 10, "rank1 parameter w": 11}
    one = adapter(1, False, FakeEngine(1, {"vsnap_fingerprint": {"parameter w": 10}}))
    assert asyncio.run(one._fingerprint()) == {"parameter w": 10}  # one rank: names as before


# --- the orchestrator ---------------------------------------------------------------------------

def test_one_rank_trees_keep_the_environment_they_had(tmp_path) -> None:
    """The TP variables are the engine's to set, and only with TP > 1 (vllm.py sets them before its
    workers spawn): with one rank they would change vLLM's compile-cache key and what every
    existing one-GPU capture and cold start ran with."""
    from vsnap.ops.tree import tree_environment

    for engine in ("vllm", "cpu"):
        env = tree_environment(tmp_path / "control", tmp_path, engine)
        assert not set(vllm_rules.TP_ENVIRONMENT) & set(env), engine


def test_capture_takes_the_first_gpus_in_cuda_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.host import cuda as _cuda
    from vsnap.ops import capture as _capture
    from vsnap.protocol.errors import HostNotReady

    gpus = [{"index": i, "uuid": f"GPU-{i}"} for i in range(2)]
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", gpus))
    assert _capture.capture_gpu_uuids(2) == ["GPU-0", "GPU-1"]
    assert _capture.capture_gpu_uuids() == ["GPU-0"]  # one rank: the first, as before
    with pytest.raises(HostNotReady, match="tensor_parallel_size 3 needs 3 GPUs; this host has 2"):
        _capture.capture_gpu_uuids(3)
    mixed = [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H200"}, {"index": 1, "uuid": "GPU-1", "name": "NVIDIA H100"}]
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", mixed))
    assert _capture.capture_gpu_uuids() == ["GPU-0"]  # one rank: one model whatever the others are
    with pytest.raises(HostNotReady, match=r"different models \(NVIDIA H200, NVIDIA H100\)"):
        _capture.capture_gpu_uuids(2)
    _capture.require_visible_gpus("GPU-1,GPU-0", 2)
    with pytest.raises(HostNotReady, match="CUDA_VISIBLE_DEVICES='GPU-1' names 1 GPU"):
        _capture.require_visible_gpus("GPU-1", 2)


def test_host_facts_keep_the_visible_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.host import cuda as _cuda
    from vsnap.host import facts as _host

    gpus = [{"index": i, "uuid": f"GPU-{c}", "name": "H200", "memory_bytes": 1} for i, c in enumerate("abc")]
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", gpus))
    monkeypatch.setattr(_host, "vllm_device", lambda: "cuda")
    monkeypatch.setattr(_host.CriuRunner, "locate", classmethod(lambda cls: SimpleNamespace(version=lambda: (4, 2))))
    assert [g["uuid"] for g in _host.host_facts("vllm", visible="GPU-c,GPU-a").gpus] == ["GPU-c", "GPU-a"]
    assert [g["uuid"] for g in _host.host_facts("vllm", visible="1").gpus] == ["GPU-b"]


def test_spec_tensor_parallel_size() -> None:
    assert vllm_rules.tensor_parallel_size({"tensor_parallel_size": 2}) == 2
    assert vllm_rules.tensor_parallel_size({"tensor-parallel-size": " 2 "}) == 2
    assert vllm_rules.tensor_parallel_size({"tensor_parallel_size": False}) == 1
    assert vllm_rules.tensor_parallel_size({"tensor_parallel_size": "two"}) == 1
    assert vllm_rules.tensor_parallel_size({}) == 1


def test_open_device_files_finds_what_a_process_holds(tmp_path) -> None:
    from vsnap.host.proctree import open_device_files

    with open(os.devnull) as held:  # /dev/null stands for /dev/nvidia0 here
        found = open_device_files([os.getpid(), 2 ** 22 + 7], prefix="/dev/null")
        assert found == {os.getpid(): ["/dev/null"]} and held
    assert open_device_files([os.getpid()]) == {}  # this test process holds no GPU device


def test_open_device_files_finds_a_gpu_major_wherever_its_node_lives(tmp_path) -> None:
    """A character device of the GPU's major is found by its device number, not only under
    /dev/nvidia* (here /dev/null's major stands for 195, and a second node made with mknod for a
    node outside /dev)."""
    from vsnap.host.proctree import gpu_device_majors, open_device_files

    null_major = os.major(os.stat(os.devnull).st_rdev)
    with open(os.devnull) as held:
        assert "/dev/null" in open_device_files([os.getpid()], majors={null_major})[os.getpid()] and held
    if os.geteuid() == 0:
        node = tmp_path / "not-a-gpu-path"
        os.mknod(node, 0o600 | stat.S_IFCHR, os.stat(os.devnull).st_rdev)
        assert str(node) not in open_device_files([os.getpid()], majors={null_major}).get(os.getpid(), [])
        with open(node) as held:
            assert str(node) in open_device_files([os.getpid()], majors={null_major})[os.getpid()] and held
        assert str(node) not in open_device_files([os.getpid()]).get(os.getpid(), [])  # major 1 is not a GPU's
    devices = tmp_path / "devices"
    devices.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n511 nvidia-caps\n\n"
                       "Block devices:\n  7 loop\n")
    assert gpu_device_majors(str(devices)) == {195, 508, 511}
    assert gpu_device_majors(str(tmp_path / "absent")) == {195}


def test_a_gpu_device_file_left_open_fails_the_capture_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from vsnap.ops import capture as _capture
    from vsnap.protocol.errors import ProcessTreeError

    _capture.require_no_gpu_files([os.getpid()], tmp_path)  # nothing held: passes
    monkeypatch.setattr(_capture, "open_device_files",
                        lambda pids: {2 ** 22 + 9: ["/dev/nvidia-uvm"], 2 ** 22 + 8: ["/dev/nvidia0", "/dev/nvidiactl"]})
    with pytest.raises(ProcessTreeError) as info:
        _capture.require_no_gpu_files([2 ** 22 + 8, 2 ** 22 + 9], tmp_path)
    message = str(info.value.message)
    assert message == (f"/dev/nvidia0, /dev/nvidiactl still open after the CUDA checkpoint in pid {2 ** 22 + 8} (?) "
                       "(and 1 more processes): CRIU cannot dump a GPU device file")
    assert info.value.phase == "cuda checkpoint" and "troubleshooting" in info.value.hint


def test_an_inherited_cuda_visible_devices_records_the_gpus_the_ranks_see(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CUDA_VISIBLE_DEVICES=1,0 vsnap capture` on a host of GPUs a (0) and b (1): vsnap's own CUDA
    sees b as index 0 and a as index 1, as the tree does; looking the indices up in that view
    recorded rank 0 on a (it ran on b), and `=2,3` on four GPUs found none (no map at restore:
    the ranks came back on their old GPUs, not the ones vsnap chose and checked)."""
    from vsnap.host import cuda as _cuda
    from vsnap.host import facts as _host
    from vsnap.ops import capture as _capture

    seen = [{"index": 0, "uuid": "GPU-b", "name": "H200", "memory_bytes": 1},
            {"index": 1, "uuid": "GPU-a", "name": "H200", "memory_bytes": 1}]  # vsnap's view under 1,0
    monkeypatch.setattr(_cuda, "gpu_facts", lambda: ("580", "13.0", seen))
    monkeypatch.setattr(_host, "vllm_device", lambda: "cuda")
    monkeypatch.setattr(_host.CriuRunner, "locate", classmethod(lambda cls: SimpleNamespace(version=lambda: (4, 2))))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    env = {"CUDA_VISIBLE_DEVICES": "1,0"}  # tree_environment copies the caller's
    assert [g["uuid"] for g in _host.host_facts("vllm", visible=_capture.recorded_visible(env)).gpus] == [
        "GPU-b", "GPU-a"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # vsnap set it itself (UUIDs): picked by name
    assert _capture.recorded_visible({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) == "GPU-a,GPU-b"


def test_the_tls_files_are_what_the_restored_server_reads() -> None:
    """A restore checks them again (uvicorn reads them as root after every restore): both spellings
    of the key, nothing that is not a path; TLS is on with either file."""
    assert vllm_serve_args.files_read_when_serving({"ssl_keyfile": "/k.pem", "ssl-certfile": "/c.pem",
                                               "ssl_ca_certs": "", "port": 1}) == [("ssl_keyfile", "/k.pem"),
                                                                                  ("ssl_certfile", "/c.pem")]
    assert vllm_serve_args.files_read_when_serving({"ssl_keyfile": 5, "tokenizer": "/t"}) == []
    assert vllm_serve_args.serves_tls({"ssl-certfile": "/c.pem"}) and vllm_serve_args.serves_tls({"ssl_keyfile": "/k"})
    assert not vllm_serve_args.serves_tls({"ssl_ca_certs": "/ca.pem", "ssl_keyfile": ""})


def test_a_former_name_of_vsnaps_worker_extension_is_refused_naming_the_current_one() -> None:
    """The rooms moved the class (session 12): a spec that spells out an old name would make vLLM
    import a module that no longer exists; it is told the name to use instead."""
    for former in vllm_rules.FORMER_WORKER_EXTENSIONS:
        refusals = vllm_rules.value_refusals("serve.worker_extension_cls", "worker_extension_cls", former)
        assert len(refusals) == 1 and vllm_rules.VSNAP_WORKER_EXTENSION in refusals[0].reason
    assert vllm_rules.value_refusals("serve.worker_extension_cls", "worker_extension_cls",
                                     vllm_rules.VSNAP_WORKER_EXTENSION) == []
